"""LoRA adapters in the engine: a request through an adapter computes what the model with
the adapter merged into its weights computes (transformers as the oracle), whatever else
shares its steps; the prefix cache keeps each adapter's KV apart; max_loras holds."""

from __future__ import annotations

import json
import os

import pytest
import torch
from lora_adapters import build_adapter, merge_adapter
from parity import assert_same_greedy, hf_reference, parity_prompts

from streamserve import LLM, LoRARequest, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def adapters(model_dirs, tmp_path_factory):
    """Per architecture: (adapter directory, merged model directory) for two adapters: "a" on
    every projection, rank 8; "b" on q/v and down only, rank 3 with rsLoRA, one layer only."""
    root = tmp_path_factory.mktemp("lora")
    made = {}
    for arch in ("llama", "qwen2", "phi3"):
        model = model_dirs[arch]
        targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if arch == "phi3" else None
        a = build_adapter(str(root / arch / "a"), model, rank=8, seed=1, **({"targets": targets} if targets else {}))
        b = build_adapter(str(root / arch / "b"), model, rank=3, seed=2, rslora=True, layers=[1],
                          targets=("qkv_proj", "down_proj") if arch == "phi3" else ("q_proj", "v_proj", "down_proj"),
                          alpha_pattern={"down_proj": 3.0})
        made[arch] = {name: (path, merge_adapter(model, path, str(root / arch / f"{name}-merged")))
                      for name, path in (("a", a), ("b", b))}
    return made


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model_dirs["llama"], dtype="float32", kv_cache_memory="16MiB", enable_lora=True)


def prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": p} for p in parity_prompts()[:n]]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_adapter_matches_merged_weights(arch, model_dirs, adapters):
    llm = LLM(model_dirs[arch], dtype="float32", kv_cache_memory="16MiB", enable_lora=True)
    for int_id, name in enumerate(("a", "b"), 1):
        path, merged = adapters[arch][name]
        outputs = llm.generate(prompts(4), GREEDY, use_tqdm=False, lora_request=LoRARequest(name, int_id, path))
        assert_same_greedy(outputs, hf_reference(merged, 4, 12), logprob_tol=1e-4)
    # and the model alone, after them, is itself again
    assert_same_greedy(llm.generate(prompts(4), GREEDY, use_tqdm=False), hf_reference(model_dirs[arch], 4, 12))


@pytest.mark.parametrize("eager", [False, True], ids=["c-step", "op-by-op"])
def test_adapters_and_the_model_share_steps(eager, model_dirs, adapters):
    """Nine prompts, each through the model, adapter a or adapter b in turn, in one batch: their
    rows interleave in every step (an adapter's scattered rows, gathered by index). On the CPU
    a step of a few hundred tokens runs in one C call, which adds the adapters itself; with
    enforce_eager every step runs op by op, the adapters added by torch."""
    llm = LLM(model_dirs["llama"], dtype="float32", kv_cache_memory="16MiB", enable_lora=True, enforce_eager=eager)
    assert (llm.engine_core.model_runner.c_step is None) == eager
    (a, a_merged), (b, b_merged) = adapters["llama"]["a"], adapters["llama"]["b"]
    plan = [None, LoRARequest("a", 1, a), LoRARequest("b", 2, b)] * 3
    outputs = llm.generate(prompts(9), GREEDY, use_tqdm=False, lora_request=plan)
    refs = {None: hf_reference(model_dirs["llama"], 9, 12), "a": hf_reference(a_merged, 9, 12),
            "b": hf_reference(b_merged, 9, 12)}
    for i, (output, lora) in enumerate(zip(outputs, plan)):
        assert_same_greedy([output], [refs[lora and lora.lora_name][i]])


def test_prefix_cache_keeps_each_adapters_kv_apart(model_dirs, adapters):
    llm = LLM(model_dirs["llama"], dtype="float32", kv_cache_memory="16MiB", enable_lora=True)
    a, a_merged = adapters["llama"]["a"]
    prompt = parity_prompts()[3]  # 70 tokens: four full blocks
    base = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    lora = LoRARequest("a", 1, a)
    first = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=lora)[0]
    again = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=lora)[0]
    assert first.num_cached_tokens == 0  # the model's blocks of the same prompt are not the adapter's
    assert again.num_cached_tokens == 64  # the adapter's own are
    ref = hf_reference(a_merged, 4, 12)[3]
    assert_same_greedy([first, again], [ref, ref])
    assert base.outputs[0].token_ids != first.outputs[0].token_ids


def test_max_loras_bounds_the_adapters_of_a_step(model_dirs, adapters, tmp_path):
    """max_loras=1 with three adapters' requests at once: no step holds two, all finish right."""
    llm = LLM(model_dirs["llama"], dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=1)
    c = build_adapter(str(tmp_path / "c"), model_dirs["llama"], rank=2, seed=3, targets=("o_proj",))
    c_merged = merge_adapter(model_dirs["llama"], c, str(tmp_path / "c-merged"))
    paths = {"a": adapters["llama"]["a"], "b": adapters["llama"]["b"], "c": (c, c_merged)}
    plan = [LoRARequest(name, " abc".index(name), paths[name][0]) for name in "abcabc"]
    seen = []
    runner = llm.engine_core.model_runner
    execute = runner.execute_model

    def recording(so):
        seen.append({new.lora.name for new in so.scheduled_new_reqs if new.lora} |
                    {runner.requests[r].lora.name for r in so.scheduled_cached_reqs.req_ids if runner.requests[r].lora})
        return execute(so)
    runner.execute_model = recording
    outputs = llm.generate(prompts(6) + prompts(2), GREEDY, use_tqdm=False, lora_request=plan + [None, None])
    assert max(len(s) for s in seen) == 1 and len(set().union(*seen)) == 3
    for i, (output, lora) in enumerate(zip(outputs[:6], plan)):
        assert_same_greedy([output], [hf_reference(paths[lora.lora_name][1], 6, 12)[i]])
    assert_same_greedy(outputs[6:], hf_reference(model_dirs["llama"], 2, 12))
    assert runner.num_lora_requests == 0 and not runner.requests  # forgotten once the engine is idle


def test_priority_preempts_nobody_for_a_request_max_loras_would_pass_over(model_dirs, adapters):
    """Under the priority policy, a waiting request of a higher rank whose adapter would be one
    too many (max_loras 1) does not make the scheduler preempt a running request each step (to
    readmit it at once, recomputing it): it waits for a seat its adapter may take."""
    llm = LLM(model_dirs["llama"], dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=1,
              max_num_seqs=2, scheduling_policy="priority")
    (a, a_merged), (b, b_merged) = adapters["llama"]["a"], adapters["llama"]["b"]
    core, loras = llm.engine_core, llm.engine_core.loras
    ids = [llm._add_request(None, p["prompt_token_ids"], GREEDY, priority=1, lora=loras.for_request(LoRARequest("a", 1, a)))
           for p in prompts(2)]
    for _ in range(3):  # the two running
        llm.output_processor.process_outputs(core.step())
    ids.append(llm._add_request(None, prompts(3)[2]["prompt_token_ids"], GREEDY, priority=0,
                                lora=loras.for_request(LoRARequest("b", 2, b))))
    outputs = {o.request_id: o for o in llm._run_engine(ids, use_tqdm=False)}
    assert core.scheduler.num_preemptions == 0
    for i, request_id in enumerate(ids):
        assert_same_greedy([outputs[request_id]], [hf_reference(a_merged if i < 2 else b_merged, 3, 12)[i]])


def test_a_request_passed_over_for_max_loras_is_not_overtaken_by_later_ones(model_dirs, adapters):
    """max_loras 1, adapter a running: a request for b waits; a later request for a waits behind
    it too (else a's stream of requests could keep b out for ever), and a request for the model
    alone starts. b runs once a's first request ends, then a's second."""
    llm = LLM(model_dirs["llama"], dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=1)
    (a, _), (b, _) = adapters["llama"]["a"], adapters["llama"]["b"]
    core, loras = llm.engine_core, llm.engine_core.loras
    la, lb = loras.for_request(LoRARequest("a", 1, a)), loras.for_request(LoRARequest("b", 2, b))
    ps = [p["prompt_token_ids"] for p in prompts(4)]
    first = llm._add_request(None, ps[0], GREEDY, lora=la)
    llm.output_processor.process_outputs(core.step())
    ids = [first, llm._add_request(None, ps[1], GREEDY, lora=lb), llm._add_request(None, ps[2], GREEDY, lora=la),
           llm._add_request(None, ps[3], GREEDY)]
    started: dict[str, int] = {}
    finished: dict[str, int] = {}
    step = 0
    while core.has_unfinished_requests():
        step += 1
        for request in core.scheduler.running:
            started.setdefault(request.request_id.split("#")[0], step)
        for output in llm.output_processor.process_outputs(core.step()).finished:
            finished[output.request_id] = step
    first_b, second_a, plain = ids[1], ids[2], ids[3]
    assert started[plain] <= 2  # the model's own request did not wait
    assert started[first_b] > finished[first] and started[second_a] > started[first_b]


def test_alpha_pattern_keys_match_as_peft_matches_them():
    from streamserve.lora.adapter import _alpha

    module = "layers.1.self_attn.q_proj"  # (PEFT's name for it: model.layers.1.self_attn.q_proj)
    for key, matches in [("model.layers.1.self_attn.q_proj", True), (r"^model\.layers\.1\..*", True),
                         ("q_proj", True), ("layers.1.self_attn.q_proj", True), ("layers.2.self_attn.q_proj", False),
                         ("proj", False)]:
        assert _alpha("x", {"lora_alpha": 16, "alpha_pattern": {key: 64}}, module) == (64 if matches else 16), key
    assert _alpha("x", {}, module) == 8  # PEFT's default lora_alpha
    for bad, why in [({"alpha_pattern": ["q_proj"]}, "not an object"), ({"alpha_pattern": {"q_proj(": 4}}, "regular"),
                     ({"lora_alpha": "16"}, "not a number")]:
        with pytest.raises(ValueError, match=why):
            _alpha("x", bad, module)


def test_bfloat16_c_step_adds_the_adapter_as_torch_does(model_dirs, adapters):
    """A bfloat16 checkpoint's C step reads the adapters packed in bfloat16 as its weights (an
    odd rank padded to pairs); its prompt logprobs stay within bfloat16's reach of the op-by-op
    path's, which adds them in float32, and far from the model's own."""
    path, _ = adapters["llama"]["b"]  # rank 3
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in parity_prompts()[:4]]
    got = {}
    for eager in (False, True):
        llm = LLM(model_dirs["llama"], dtype="bfloat16", kv_cache_memory="16MiB", enable_lora=True, enforce_eager=eager)
        for lora in (None, LoRARequest("b", 1, path)):
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
            got[eager, lora is not None] = [e[t].logprob for o, p in zip(outputs, prompts)
                                            for e, t in zip(o.prompt_logprobs[1:], p["prompt_token_ids"][1:])]
    diff = lambda x, y: max(abs(a - b) for a, b in zip(got[x], got[y]))  # noqa: E731
    assert diff((False, True), (True, True)) < 0.05
    assert diff((False, True), (False, False)) > 0.2


def test_embeddings_through_an_adapter(llm, adapters):
    a, _ = adapters["llama"]["a"]
    base = llm.embed(["hello world"], use_tqdm=False)[0].outputs.embedding
    through = llm.embed(["hello world"], use_tqdm=False, lora_request=LoRARequest("a", 1, a))[0].outputs.embedding
    assert len(base) == len(through) and abs(sum(x * x for x in through) - 1) < 1e-4
    assert max(abs(x - y) for x, y in zip(base, through)) > 1e-3


def _adapter_dir(tmp_path, model_dir, name="bad", **changes) -> str:
    path = build_adapter(str(tmp_path / name), model_dir, rank=4)
    if changes:
        with open(os.path.join(path, "adapter_config.json")) as f:
            config = json.load(f)
        config.update(changes)
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f)
    return path


def test_adapters_it_cannot_run_are_refused_by_name(llm, model_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    registry = llm.engine_core.loras
    model = model_dirs["llama"]
    cases = {"rank 4 .* greater than max_lora_rank \\(2\\)": None}
    small = LLM(model, dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_lora_rank=2)
    with pytest.raises(ValueError, match=list(cases)[0]):
        small.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, _adapter_dir(tmp_path, model)))
    with pytest.raises(ValueError, match="DoRA"):
        registry.read("x", _adapter_dir(tmp_path, model, "dora", use_dora=True))
    with pytest.raises(ValueError, match="modules_to_save"):
        registry.read("x", _adapter_dir(tmp_path, model, "save", modules_to_save=["lm_head"]))
    rank0 = _adapter_dir(tmp_path, model, "rank0")
    tensors = load_file(os.path.join(rank0, "adapter_model.safetensors"))
    save_file({k: v[:0] if "lora_A" in k else v[:, :0] for k, v in tensors.items()},
              os.path.join(rank0, "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="the model expects"):
        registry.read("x", rank0)
    with pytest.raises(ValueError, match="not a directory"):
        registry.read("x", str(tmp_path / "nowhere"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ValueError, match="no adapter_config.json"):
        registry.read("x", str(tmp_path / "empty"))
    # an adapter of another model's shape
    other = build_adapter(str(tmp_path / "other"), model_dirs["qwen3"], rank=4)
    with pytest.raises(ValueError, match="another model"):
        registry.read("x", other)
    # an embedding's adapter, and a head's
    path = _adapter_dir(tmp_path, model, "embed")
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    for extra, match in (("base_model.model.model.embed_tokens.lora_embedding_A", "embedding"),
                         ("base_model.model.lm_head.lora_A.weight", "lm_head")):
        save_file({**tensors, extra: torch.zeros(4, 64)}, os.path.join(path, "adapter_model.safetensors"))
        with pytest.raises(ValueError, match=match):
            registry.read("x", path)
    # the model without enable_lora
    plain = LLM(model, dtype="float32", kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, path))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, path)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b", "c"], GREEDY, use_tqdm=False, lora_request=[None, None])


def test_async_scheduling_with_adapters_in_the_batch(model_dirs, adapters):
    """Async scheduling: prompts through the model and each adapter in one batch, each step
    launched before the one before is read back (the adapters' rows take their tokens in flight
    like any other): the tokens of waiting for each step."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plan = [None, LoRARequest("a", 1, adapters["llama"]["a"][0]), LoRARequest("b", 2, adapters["llama"]["b"][0])] * 3

    def run(mode: str) -> list[list[int]]:
        llm = LLM(model_dirs["llama"], dtype="float32", kv_cache_memory="16MiB", enable_lora=True,
                  async_scheduling=mode)
        return [o.outputs[0].token_ids for o in llm.generate(prompts(9), params, use_tqdm=False, lora_request=plan)]
    assert run("on") == run("off")
