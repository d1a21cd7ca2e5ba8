"""The Sampler on hand-made logits: greedy, top-k / top-p / min-p, temperature,
per-request seeds, penalties, logprobs and min_tokens."""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import pytest
import torch

from streamserve.engine.scheduler_output import NewRequestData
from streamserve.sampling_params import SamplingParams
from streamserve.worker.request_state import RequestState
from streamserve.worker import sampler as sampler_module
from streamserve.worker.sampler import Sampler

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, params=["c", "torch"])
def choice_path(request, monkeypatch):
    """Every test on both ways a CPU sampler chooses: the C kernels' (where they build) and torch's."""
    if request.param == "c" and sampler_module._cpu_kernels() is None:
        pytest.skip("the CPU kernels do not build here")
    if request.param == "torch":
        monkeypatch.setattr(sampler_module, "_cpu_kernels", lambda: None)
    return request.param


def make_row(params: SamplingParams, prompt: Sequence[int] = (0,), output: Sequence[int] = (),
             eos: Optional[int] = None, req_id: str = "r") -> RequestState:
    """A RequestState as the model runner builds it (a seeded request owns a generator)."""
    new = NewRequestData(req_id, list(prompt) + list(output), len(prompt), params, eos,
                         block_ids=[], num_computed_tokens=0)
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=CPU)
        generator.manual_seed(params.seed)
    return RequestState(new, generator)


def frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    c = Counter(tokens)
    return torch.tensor([c[i] / len(tokens) for i in range(vocab)])


# -- greedy -------------------------------------------------------------------


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    rows = [make_row(SamplingParams(temperature=0.0), req_id=str(i)) for i in range(8)]
    tokens, logprobs = Sampler(CPU, seed=0)(logits, rows)
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs is None  # nobody asked for logprobs


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    torch.manual_seed(1)
    logits = torch.randn(6, 40)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5),
              SamplingParams(temperature=0.0, top_k=3), SamplingParams(temperature=2.0, seed=3),
              SamplingParams(temperature=0.0, seed=7), SamplingParams(temperature=1.0, top_p=0.5)]
    rows = [make_row(p, req_id=str(i)) for i, p in enumerate(params)]
    argmax = logits.argmax(-1).tolist()
    sampler = Sampler(CPU, seed=0)
    for _ in range(20):
        tokens, _ = sampler(logits, rows)
        for i in (0, 2, 4):
            assert tokens[i] == argmax[i]


def test_half_precision_logits_are_accepted():
    logits = torch.tensor([[0.1, 3.0, -1.0, 0.5]], dtype=torch.bfloat16)
    tokens, _ = Sampler(CPU, seed=0)(logits, [make_row(SamplingParams(temperature=0.0))])
    assert tokens == [1]


# -- top-k, top-p, min-p ----------------------------------------------------------


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=50.0, top_k=1),
    SamplingParams(temperature=50.0, top_p=1e-6),
    SamplingParams(temperature=50.0, top_p=1e-6, top_k=10),
], ids=["top_k=1", "tiny-top_p", "tiny-top_p+top_k"])
def test_top_k_one_and_tiny_top_p_give_the_argmax_even_when_hot(params):
    torch.manual_seed(2)
    logits = torch.randn(400, 64)
    rows = [make_row(params, req_id=str(i)) for i in range(400)]
    tokens, _ = Sampler(CPU, seed=0)(logits, rows)
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_samples_only_and_all_of_the_k_best():
    torch.manual_seed(3)
    row_logits = torch.randn(100)
    n = 3000
    logits = row_logits.expand(n, -1).clone()
    rows = [make_row(SamplingParams(temperature=5.0, top_k=5), req_id=str(i)) for i in range(n)]
    tokens, _ = Sampler(CPU, seed=0)(logits, rows)
    top5 = set(row_logits.topk(5).indices.tolist())
    assert set(tokens) == top5


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 6000
    logits = probs.log().expand(n, -1).clone()
    half = n // 2
    # Rows 0..half-1: top_p=0.7 -> {0, 1} (0.5 < 0.7, 0.8 >= 0.7).
    # Rows half..n-1: top_p=0.85 -> {0, 1, 2} (0.8 < 0.85, 0.95 >= 0.85).
    rows = ([make_row(SamplingParams(top_p=0.7), req_id=f"a{i}") for i in range(half)]
            + [make_row(SamplingParams(top_p=0.85), req_id=f"b{i}") for i in range(half)])
    tokens, _ = Sampler(CPU, seed=0)(logits, rows)
    first, second = tokens[:half], tokens[half:]
    assert set(first) == {0, 1}
    assert set(second) == {0, 1, 2}
    # The kept tokens keep their relative weights (renormalised).
    f = frequencies(first, 4)
    assert abs(f[0].item() - 0.5 / 0.8) < 0.04
    f = frequencies(second, 4)
    assert abs(f[2].item() - 0.15 / 0.95) < 0.03


def test_min_p_never_samples_tokens_below_min_p_times_max():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    n = 5000
    logits = probs.log().expand(n, -1).clone()
    # threshold = 0.3 * 0.4 = 0.12: tokens 3 (0.10) and 4 (0.05) are out.
    rows = [make_row(SamplingParams(temperature=1.0, min_p=0.3), req_id=str(i)) for i in range(n)]
    tokens, _ = Sampler(CPU, seed=0)(logits, rows)
    assert set(tokens) == {0, 1, 2}
    f = frequencies(tokens, 5)
    expected = torch.tensor([0.4, 0.3, 0.15, 0.0, 0.0]) / 0.85
    assert torch.allclose(f, expected, atol=0.04)


def test_min_p_applies_per_row():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    n = 2000
    logits = probs.log().expand(2 * n, -1).clone()
    rows = ([make_row(SamplingParams(min_p=0.3), req_id=f"a{i}") for i in range(n)]
            + [make_row(SamplingParams(min_p=0.0), req_id=f"b{i}") for i in range(n)])
    tokens, _ = Sampler(CPU, seed=0)(logits, rows)
    assert set(tokens[:n]) == {0, 1, 2}
    assert set(tokens[n:]) == {0, 1, 2, 3, 4}


def test_top_p_one_row_keeps_its_whole_distribution_next_to_top_p_rows():
    """A row with top_p=1.0 (off) must not lose tokens because another row in the
    batch asked for top-k/top-p. The descending-cumsum test `mass_before >= top_p`
    drops the tail of a top_p=1.0 row once float32 rounding carries its cumulative
    mass to 1.0 before the end of the vocabulary."""
    _filtered_probs = Sampler(CPU, seed=0)._filtered_probs
    torch.manual_seed(0)
    logits = torch.randn(4, 384) * 3
    rows = [make_row(SamplingParams(), req_id=str(i)) for i in range(3)]
    rows.append(make_row(SamplingParams(top_k=5, top_p=0.5), req_id="3"))
    probs = _filtered_probs(logits, rows)
    alone = _filtered_probs(logits[:3], rows[:3])
    assert torch.equal(alone, torch.softmax(logits[:3], -1))
    assert int((probs[:3] == 0).sum()) == 0, "top_p=1.0 rows lost tokens to float rounding"


# -- temperature ------------------------------------------------------------------


def test_temperature_sampling_matches_softmax():
    row_logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    n = 16000
    logits = row_logits.expand(2 * n, -1).clone()
    rows = ([make_row(SamplingParams(temperature=0.5), req_id=f"a{i}") for i in range(n)]
            + [make_row(SamplingParams(temperature=2.0), req_id=f"b{i}") for i in range(n)])
    tokens, _ = Sampler(CPU, seed=1234)(logits, rows)
    for part, temp in ((tokens[:n], 0.5), (tokens[n:], 2.0)):
        expected = torch.softmax(row_logits / temp, -1)
        observed = frequencies(part, 6)
        assert torch.allclose(observed, expected, atol=0.02), (temp, observed, expected)
    # The hotter half is visibly flatter.
    assert Counter(tokens[:n])[5] > Counter(tokens[n:])[5] + 0.2 * n


def test_unseeded_rows_follow_the_sampler_seed():
    torch.manual_seed(5)
    logits = torch.randn(64, 200)
    rows = [make_row(SamplingParams(temperature=1.0), req_id=str(i)) for i in range(64)]
    a, _ = Sampler(CPU, seed=11)(logits, rows)
    b, _ = Sampler(CPU, seed=11)(logits, rows)
    c, _ = Sampler(CPU, seed=12)(logits, rows)
    assert a == b
    assert a != c


# -- per-request seeds ----------------------------------------------------------------

TARGET_LOGITS = torch.linspace(-1.0, 1.0, 300)[torch.randperm(300, generator=torch.Generator().manual_seed(0))]


def _target_tokens(seed: int, layout: str, steps: int = 12, sampler_seed: int = 0) -> list[int]:
    """The target request's tokens over `steps` calls, in a batch of the given layout."""
    target = make_row(SamplingParams(temperature=1.0, seed=seed), req_id="target")
    g = torch.Generator().manual_seed(99)
    others = {
        "x": lambda i: make_row(SamplingParams(temperature=1.0), req_id=f"x{i}"),
        "k": lambda i: make_row(SamplingParams(temperature=0.7, top_k=3, seed=99), req_id=f"k{i}"),
        "p": lambda i: make_row(SamplingParams(temperature=1.3, top_p=0.5, min_p=0.1), req_id=f"p{i}"),
        "g": lambda i: make_row(SamplingParams(temperature=0.0), req_id=f"g{i}"),
        "s": lambda i: make_row(SamplingParams(temperature=1.0, seed=seed + 1), req_id=f"s{i}"),
    }
    rows = [target if ch == "T" else others[ch](i) for i, ch in enumerate(layout)]
    sampler = Sampler(CPU, seed=sampler_seed)
    result = []
    for _ in range(steps):
        logits = torch.randn(len(rows), 300, generator=g) * 2
        logits[layout.index("T")] = TARGET_LOGITS
        tokens, _ = sampler(logits, rows)
        for row, token in zip(rows, tokens):  # as the runner appends them (a seed draws by position)
            row.token_ids.append(token)
        result.append(tokens[layout.index("T")])
    return result


def test_seeded_request_is_independent_of_its_batch():
    alone = _target_tokens(1234, "T")
    assert len(set(alone)) > 6  # it really samples
    for layout, sampler_seed in (("xTk", 1), ("kpxT", 2), ("Tgsx", 3), ("pxxxxxxxxxT", 4), ("sT", 5)):
        assert _target_tokens(1234, layout, sampler_seed=sampler_seed) == alone, layout


def test_different_seeds_give_different_tokens():
    assert _target_tokens(1234, "xT") != _target_tokens(1235, "xT")
    assert _target_tokens(1234, "T") != _target_tokens(99, "T")


def test_seeded_rows_with_the_same_seed_draw_the_same_tokens_in_one_batch():
    torch.manual_seed(6)
    row_logits = torch.randn(300)
    logits = row_logits.expand(5, -1).clone()
    params = SamplingParams(temperature=1.0, seed=42)
    rows = [make_row(params, req_id=str(i)) for i in range(4)]
    rows.insert(2, make_row(SamplingParams(temperature=1.0), req_id="x"))
    sampler = Sampler(CPU, seed=0)
    for _ in range(5):
        tokens, _ = sampler(logits, rows)
        seeded = tokens[:2] + tokens[3:]
        assert len(set(seeded)) == 1
        for row, token in zip(rows, tokens):
            row.token_ids.append(token)


# -- penalties --------------------------------------------------------------------------


def test_apply_penalties_matches_hand_computation():
    raw = torch.tensor([2.0, -1.0, 0.5, -0.5, 1.5, 0.0, 3.0, -2.0])
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    row = make_row(params, prompt=[0, 1], output=[2, 2, 3, 0])
    plain = make_row(SamplingParams(), prompt=[0, 1], output=[2, 2, 3, 0])
    out = Sampler(CPU, seed=0).apply_penalties(torch.stack([raw, raw]), [row, plain])
    expected = torch.tensor([
        2.0 / 1.5 - 0.3 * 1 - 0.2,   # prompt + output (1x): divided, freq 1, presence
        -1.0 * 1.5,                  # prompt only, negative: multiplied; no freq/presence
        0.5 / 1.5 - 0.3 * 2 - 0.2,   # output 2x
        -0.5 * 1.5 - 0.3 * 1 - 0.2,  # output 1x, negative
        1.5, 0.0, 3.0, -2.0,         # never seen: untouched
    ])
    assert torch.allclose(out[0], expected, atol=1e-6)
    assert torch.equal(out[1], raw)  # a row without penalties is left alone


def test_c_penalties_match_the_torch_path(choice_path):
    """The C kernels' penalties (a pass over each row's own tokens) give the torch path's logits:
    repeated and prompt-only tokens, rows with one penalty, all three, or none, tokens at both
    ends of the vocabulary."""
    if choice_path != "c":
        pytest.skip("the C path's own test")
    gen = torch.Generator().manual_seed(8)
    vocab = 1000
    settings = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.4), dict(presence_penalty=-0.7),
                dict(repetition_penalty=0.8, frequency_penalty=0.2, presence_penalty=0.3), dict()]
    rows = []
    for i, kw in enumerate(settings * 2):
        prompt = torch.randint(0, vocab, (30,), generator=gen).tolist() + [0, vocab - 1]
        output = torch.randint(0, 40, (25,), generator=gen).tolist() + [vocab - 1]  # repeats
        rows.append(make_row(SamplingParams(**kw), prompt=prompt, output=output, req_id=str(i)))
    logits = torch.randn(len(rows), vocab, generator=gen) * 3
    sampler = Sampler(CPU, seed=0)
    before = logits.clone()
    c = sampler._penalties_in_c(logits, rows)
    assert torch.equal(logits, before)  # on a copy
    torch.testing.assert_close(c, sampler.apply_penalties(logits, rows), rtol=1e-6, atol=1e-6)
    assert not torch.equal(c, logits)


@pytest.mark.parametrize("params, prompt, output, expected", [
    # repetition: positive seen logit divided (2.0 -> 1.0 < 1.5)
    (SamplingParams(temperature=0, repetition_penalty=2.0), [0], [], 1),
    # ...also when the token appeared only in the output
    (SamplingParams(temperature=0, repetition_penalty=2.0), [5], [0], 1),
    # frequency counts output tokens: 2.0 - 3 * 0.2 = 1.4 < 1.5
    (SamplingParams(temperature=0, frequency_penalty=0.2), [5], [0, 0, 0], 1),
    # one occurrence is not enough: 2.0 - 0.2 = 1.8 > 1.5
    (SamplingParams(temperature=0, frequency_penalty=0.2), [5], [0], 0),
    # frequency ignores the prompt
    (SamplingParams(temperature=0, frequency_penalty=2.0), [0, 0, 0, 0], [], 0),
    # presence: once, whatever the count: 2.0 - 0.6 = 1.4 < 1.5
    (SamplingParams(temperature=0, presence_penalty=0.6), [5], [0], 1),
    (SamplingParams(temperature=0, presence_penalty=0.4), [5], [0, 0, 0, 0, 0], 0),
    # presence ignores the prompt
    (SamplingParams(temperature=0, presence_penalty=2.0), [0], [], 0),
    # negative presence penalty pulls a seen token up: 1.5 + 1.0 > 2.0
    (SamplingParams(temperature=0, presence_penalty=-1.0), [5], [1], 1),
], ids=["rep-prompt", "rep-output", "freq-3x", "freq-1x", "freq-prompt", "pres-1x", "pres-5x",
        "pres-prompt", "pres-negative"])
def test_penalties_change_the_greedy_choice(params, prompt, output, expected):
    logits = torch.tensor([[2.0, 1.5, -3.0, -3.0, -3.0, -3.0]])
    tokens, _ = Sampler(CPU, seed=0)(logits, [make_row(params, prompt=prompt, output=output)])
    assert tokens == [expected]


def test_repetition_penalty_multiplies_negative_logits():
    logits = torch.tensor([[-1.0, -1.2, -5.0, -5.0]])
    params = SamplingParams(temperature=0, repetition_penalty=1.5)  # -1.0 -> -1.5 < -1.2
    tokens, _ = Sampler(CPU, seed=0)(logits, [make_row(params, prompt=[0])])
    assert tokens == [1]
    # Unseen, token 0 stays the argmax.
    tokens, _ = Sampler(CPU, seed=0)(logits, [make_row(params, prompt=[3])])
    assert tokens == [0]


# -- logprobs -----------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_ranks_and_sorted_top_n():
    torch.manual_seed(7)
    vocab = 50
    logits = torch.randn(6, vocab) * 2
    raw = torch.log_softmax(logits, -1)
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.7, logprobs=5, seed=1),
        SamplingParams(temperature=0),  # no logprobs asked
        SamplingParams(temperature=1.5, logprobs=0, seed=2),
        SamplingParams(temperature=0, logprobs=20, repetition_penalty=2.0, frequency_penalty=1.0),
        SamplingParams(temperature=2.0, logprobs=1, min_tokens=4),
    ]
    argmax = logits.argmax(-1).tolist()
    rows = [make_row(p, prompt=[argmax[i]], output=[argmax[i]] if i == 4 else [], eos=argmax[5],
                     req_id=str(i)) for i, p in enumerate(params)]
    tokens, logprobs = Sampler(CPU, seed=0)(logits, rows)
    assert logprobs is not None and len(logprobs) == 6
    assert logprobs[2] is None
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        lp = logprobs[i]
        tok = tokens[i]
        assert lp.sampled_logprob == pytest.approx(raw[i, tok].item(), abs=1e-5)
        assert lp.sampled_rank == 1 + int((raw[i] > raw[i, tok]).sum())
        n = p.logprobs
        assert len(lp.top_token_ids) == n and len(lp.top_logprobs) == n
        order = raw[i].argsort(descending=True)[:n].tolist()
        assert lp.top_token_ids == order
        assert lp.top_logprobs == pytest.approx(raw[i, order].tolist(), abs=1e-5)
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
    assert logprobs[0].sampled_rank == 1
    assert logprobs[3].top_token_ids == [] and logprobs[3].top_logprobs == []
    # Row 4: penalties moved the choice off the raw argmax; logprobs still describe raw logits.
    assert tokens[4] != argmax[4]
    assert logprobs[4].sampled_rank > 1
    # Row 5: EOS (its raw argmax) was suppressed by min_tokens, yet it is still ranked first.
    assert tokens[5] != argmax[5]
    assert logprobs[5].top_token_ids == [argmax[5]]
    assert logprobs[5].sampled_rank > 1


def test_logprobs_ignore_temperature():
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
    raw = torch.log_softmax(logits, -1)
    for temp in (0.3, 3.0):
        params = SamplingParams(temperature=temp, top_k=1, logprobs=2)
        tokens, logprobs = Sampler(CPU, seed=0)(logits, [make_row(params)])
        assert tokens == [1]
        assert logprobs[0].sampled_logprob == pytest.approx(raw[0, 1].item(), abs=1e-6)
        assert logprobs[0].top_logprobs == pytest.approx([raw[0, 1].item(), raw[0, 0].item()], abs=1e-6)


# -- min_tokens -------------------------------------------------------------------------------


def test_min_tokens_suppresses_eos_and_stop_token_ids_until_reached():
    eos, stop = 5, 6
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 10.0, 9.0, 1.0]])
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop])
    for n_out, expected in ((0, 7), (1, 7), (2, 7), (3, eos), (5, eos)):
        row = make_row(params, prompt=[1, 2], output=[0] * n_out, eos=eos)
        tokens, _ = Sampler(CPU, seed=0)(logits, [row])
        assert tokens == [expected], n_out
    # Without EOS known, the stop token is still suppressed, then allowed.
    row = make_row(params, prompt=[1], output=[], eos=None)
    assert Sampler(CPU, seed=0)(logits, [row])[0] == [eos]
    row = make_row(SamplingParams(temperature=0, min_tokens=3), prompt=[1], output=[0], eos=None)
    assert Sampler(CPU, seed=0)(logits, [row])[0] == [eos]


def test_min_tokens_never_samples_stops_and_leaves_other_rows_alone():
    eos, stop = 5, 6
    logits = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 3.0, 0.0]).expand(2000, -1).clone()
    params = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[stop])
    rows = [make_row(params, output=[1], eos=eos, req_id=f"a{i}") for i in range(1000)]
    rows += [make_row(SamplingParams(temperature=1.0, stop_token_ids=[stop]), output=[1], eos=eos,
                      req_id=f"b{i}") for i in range(1000)]
    tokens, _ = Sampler(CPU, seed=0)(logits, rows)
    assert not {eos, stop} & set(tokens[:1000])
    assert set(tokens[:1000]) == {0, 1, 2, 3, 4, 7}
    assert {eos, stop} <= set(tokens[1000:])


# -- allowed_token_ids and bad_words (vLLM's) --------------------------------------------------


def test_allowed_token_ids_are_all_a_row_samples_and_its_logprobs_are_theirs():
    logits = torch.tensor([0.0, 5.0, 1.0, 2.0, 9.0, 0.5]).expand(600, -1).clone()
    allowed = SamplingParams(temperature=1.0, allowed_token_ids=[0, 2, 3], logprobs=1)
    rows = [make_row(allowed, req_id=f"a{i}") for i in range(300)]
    rows += [make_row(SamplingParams(temperature=1.0), req_id=f"b{i}") for i in range(300)]
    tokens, logprobs = Sampler(CPU, seed=0)(logits, rows)
    assert set(tokens[:300]) == {0, 2, 3}
    assert 4 in tokens[300:]  # the other rows keep the whole vocabulary
    expected = torch.log_softmax(torch.tensor([0.0, 1.0, 2.0]), -1)
    for token, lp in zip(tokens[:3], logprobs[:3]):
        assert lp.sampled_logprob == pytest.approx(expected[[0, 2, 3].index(token)].item(), abs=1e-5)
    row = make_row(SamplingParams(temperature=0.0, allowed_token_ids=[5, 2]))
    assert Sampler(CPU, seed=0)(logits[:1], [row])[0] == [2]


def test_a_ban_that_would_leave_nothing_to_sample_is_lifted():
    """allowed_token_ids [5] with a bad word of token 5: token 5 (what it must say), not token 0
    of a row of -inf; the other rows keep their bans."""
    logits = torch.zeros(2, 8)
    logits[:, 5] = 1.0
    only_five = make_row(SamplingParams(temperature=0, allowed_token_ids=[5], bad_words=["x"],
                                        bad_words_token_ids=[[5]]), req_id="a")
    banned = make_row(SamplingParams(temperature=0, bad_words=["x"], bad_words_token_ids=[[5]]), req_id="b")
    assert Sampler(CPU, seed=0)(logits, [only_five, banned])[0] == [5, 0]


@pytest.mark.parametrize("output, banned", [
    ((), {7}),            # a one-token word is never sampled; the two-token word has no start yet
    ((3,), {7, 4}),       # after 3, the 4 that would complete [3, 4] is banned
    ((3, 1), {7}),        # the output must end with the word's other tokens
    ((1, 3), {7, 4}),
])
def test_bad_words_ban_the_token_that_would_complete_one(output, banned):
    params = SamplingParams(temperature=0, bad_words=["x"], bad_words_token_ids=[[7], [3, 4]])
    for token in (7, 4, 2):
        logits = torch.zeros(1, 8)
        logits[0, token] = 10.0
        row = make_row(params, prompt=[3], output=output)  # the prompt's 3 does not count
        chosen = Sampler(CPU, seed=0)(logits, [row])[0][0]
        assert (chosen != token) == (token in banned), (token, output)



# -- vLLM's V1 details, and no sync but the result -----------------------------------


def test_a_tiny_temperature_samples_greedily():
    """Below 1e-5 a temperature is greedy, as in vLLM (logits / 1e-38 overflowed to inf,
    the softmax to NaN, and every draw to token 0)."""
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    rows = [make_row(SamplingParams(temperature=t), req_id=str(i)) for i, t in enumerate((1e-38, 1e-6, 0.0))]
    tokens, _ = Sampler(CPU, seed=0)(logits, rows)
    assert tokens == logits.argmax(-1).tolist()


def test_min_p_filters_before_top_p_measures_its_mass():
    """vLLM's V1 engine applies min_p before top-k/top-p: top_p's mass is taken over what
    min_p kept. probs [.5, .3, .15, .05], min_p 0.2 drops the last; renormalised, the mass
    before the third (0.84) reaches top_p 0.82, so only two remain (top_p first kept three)."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    row = make_row(SamplingParams(top_p=0.82, min_p=0.2))
    probs = Sampler(CPU, seed=0)._filtered_probs(logits, [row])
    assert (probs[0] > 0).tolist() == [True, True, False, False]


def test_the_per_row_settings_reach_the_device_through_the_staging_buffer(monkeypatch, choice_path):
    """Every per-row setting and token list goes through `stage` (pinned, non-blocking on a
    GPU), none through torch.tensor(list, device=...), a synchronous copy per call there."""
    if choice_path == "c":
        pytest.skip("the C path (CPU only) takes the settings and token lists as numpy arrays")
    staged = []
    sampler = Sampler(CPU, seed=0, stage=lambda a: staged.append(a) or torch.from_numpy(a))
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                            presence_penalty=0.5, frequency_penalty=0.3, min_tokens=4, stop_token_ids=[7],
                            logit_bias={3: 5.0}, logprobs=2)
    rows = [make_row(params, prompt=[1, 2, 3], output=[4, 4], eos=0, req_id="a"),
            make_row(SamplingParams(temperature=1.0, seed=3), req_id="b")]

    def refuse(*args, **kwargs):
        raise AssertionError("torch.tensor in the sampler")

    monkeypatch.setattr(torch, "tensor", refuse)
    tokens, logprobs = sampler(torch.randn(2, 30), rows)
    assert len(tokens) == 2 and logprobs[0] is not None and tokens[0] not in (0, 7)
    assert len(staged) >= 10


def test_a_top_k_beyond_the_vocabulary_keeps_it_all():
    """top_k of 2^70 (no upper bound in the API) is the whole vocabulary, as a top_k the
    vocabulary's size is (it overflowed the int64 column and failed the step for everyone)."""
    logits = torch.randn(2, 30)
    rows = [make_row(SamplingParams(top_k=k), req_id=str(i)) for i, k in enumerate((2 ** 70, 2))]
    probs = Sampler(CPU, seed=0)._filtered_probs(logits, rows)
    assert torch.allclose(probs[0], torch.softmax(logits[0], -1)) and int((probs[1] > 0).sum()) == 2
    sampler = Sampler(CPU, seed=0)  # and a whole call (the C path's int64 column too)
    drawn = {sampler(logits, rows)[0][0] for _ in range(200)}
    assert len(drawn) > 10
