"""streamserve_kernels/sampling.py's argmax against torch's, index for index."""

from __future__ import annotations

import pytest
import torch

from kernel_batches import randn
from streamserve_kernels import sampling
from streamserve_kernels.sampling import argmax, argmax_ref


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 64 entries, so that a small vocabulary spans several (and a partial last one)."""
    monkeypatch.setattr(sampling, "BLOCK", 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("vocab", [1, 50, 300])
def test_argmax_matches_torch(gen, device, small_blocks, dtype, vocab):
    logits = randn(gen, 5, vocab, dtype=dtype, device=device)
    assert torch.equal(argmax(logits), argmax_ref(logits))


def test_argmax_takes_the_first_of_equal_values_across_blocks(device, small_blocks):
    logits = torch.zeros(4, 300, device=device)
    logits[0, [70, 10, 299]] = 5.0   # first in an earlier block than the others
    logits[1, [200, 130]] = 5.0      # two later blocks
    logits[2, [65, 66]] = 5.0        # one block
    logits[3] = float("-inf")        # nothing but -inf: 0, as torch has it
    assert argmax(logits).tolist() == [10, 130, 65, 0] == argmax_ref(logits).tolist()


def test_argmax_counts_nan_as_the_largest_as_torch_does(device, small_blocks):
    logits = torch.zeros(3, 300, device=device)
    logits[0, [250, 100]] = float("nan")
    logits[0, 5] = float("inf")
    logits[1, 290] = float("nan")
    logits[1, 3] = 1.0
    logits[2, 7] = 1.0
    assert argmax(logits).tolist() == [100, 290, 7] == argmax_ref(logits).tolist()


def test_argmax_reads_rows_with_a_stride_and_columns_apart(gen, device, small_blocks):
    wide = randn(gen, 3, 400, dtype=torch.float32, device=device)
    logits = wide[:, :300]
    assert torch.equal(argmax(logits), argmax_ref(logits))
    columns_apart = wide.t().contiguous().t()
    assert torch.equal(argmax(columns_apart), argmax_ref(columns_apart))


def test_argmax_refuses_misfit_logits(device):
    with pytest.raises(ValueError, match="argmax takes logits"):
        argmax(torch.zeros(4, device=device))
    with pytest.raises(ValueError, match="argmax takes logits"):
        argmax(torch.zeros(3, 0, device=device))
    assert argmax(torch.zeros(0, 9, device=device)).shape == (0,)


# -- the sampler on it (the runner hands it over on a GPU's Triton path) ------------------------


def _rows(*params):
    from streamserve.engine.scheduler_output import NewRequestData
    from streamserve.worker.request_state import RequestState

    return [RequestState(NewRequestData(str(i), [0, 3], 2, p, 3, block_ids=[], num_computed_tokens=0), None)
            for i, p in enumerate(params)]


@pytest.fixture
def kernel_sampler(device):
    """A torch-path sampler on the kernel's argmax, with the dtypes of the logits it was handed."""
    from streamserve.worker.sampler import Sampler

    seen = []

    def spied(logits):
        seen.append(logits.dtype)
        return argmax(logits)

    sampler = Sampler(torch.device(device), seed=0, kernels=None, argmax=spied)
    sampler.seen = seen
    return sampler


def test_sampler_takes_plain_greedy_rows_on_the_logits_as_they_come(gen, kernel_sampler, device):
    from streamserve.sampling_params import SamplingParams

    logits = randn(gen, 3, 300, dtype=torch.bfloat16, device=device)
    tokens, logprobs = kernel_sampler(logits, _rows(*[SamplingParams(temperature=0.0)] * 3))
    assert tokens == logits.float().argmax(-1).tolist() and logprobs is None
    assert kernel_sampler.seen == [torch.bfloat16]  # not cast to float32 first


@pytest.mark.parametrize("asks, token", [
    (dict(min_tokens=4), 200), (dict(logprobs=2), 3), (dict(logit_bias={7: 20.0}), 7),
    (dict(allowed_token_ids=[9, 200]), 200), (dict(repetition_penalty=10.0), 200)], ids=str)
def test_sampler_applies_what_a_greedy_row_asks_before_the_kernels_argmax(kernel_sampler, device, asks, token):
    from streamserve.sampling_params import SamplingParams

    logits = torch.zeros(2, 300, dtype=torch.bfloat16, device=device)
    logits[:, 3] = 9.0  # the end-of-sequence token (3, in the prompt) is every row's largest
    logits[:, 200] = 5.0
    tokens, logprobs = kernel_sampler(logits, _rows(SamplingParams(temperature=0.0),
                                                    SamplingParams(temperature=0.0, **asks)))
    assert tokens == [3, token]
    assert (logprobs is not None and logprobs[1] is not None) == ("logprobs" in asks)
    assert kernel_sampler.seen == [torch.float32]


def test_sampler_greedy_rows_take_the_kernels_argmax_beside_sampled_ones(gen, kernel_sampler, device):
    from streamserve.sampling_params import SamplingParams

    logits = randn(gen, 4, 300, dtype=torch.bfloat16, device=device)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    tokens, _ = kernel_sampler(logits, _rows(*params))
    assert [tokens[0], tokens[2]] == logits[[0, 2]].float().argmax(-1).tolist()
    assert kernel_sampler.seen == [torch.float32]
