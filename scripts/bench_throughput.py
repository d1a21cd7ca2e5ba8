"""Offline throughput: streamserve's LLM.generate against transformers' generate.

One workload (random-token prompts, fixed output lengths, ignore_eos, greedy) runs
through both engines on the same model in the same process, and the script prints
output tokens/s for each and the ratio; then a single request decoding 128 tokens.

    python scripts/bench_throughput.py                      # random SmolLM2-135M-shaped Llama, bf16
    python scripts/bench_throughput.py --shape gemma3-270m  # random Gemma-3-270M-shaped model, bf16
    python scripts/bench_throughput.py --shape smollm3-3b --max-model-len 4096  # random SmolLM3-3B-shaped, bf16
    python scripts/bench_throughput.py --model PATH --dtype float32
    python scripts/bench_throughput.py --model smollm2-135m-instruct --num-requests 32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

SMOLLM2_SHAPE = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                     max_position_embeddings=2048, rope_theta=100000.0, rms_norm_eps=1e-5,
                     tie_word_embeddings=True)


# google/gemma-3-270m's config.json: 18 layers (every sixth full, the rest windowed to 512 keys),
# 4 query heads on 1 KV head of 256, a 262144-token tied embedding
GEMMA3_270M_SHAPE = dict(hidden_size=640, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                         head_dim=256, intermediate_size=2048, vocab_size=262144, max_position_embeddings=32768,
                         query_pre_attn_scalar=256, sliding_window=512, rms_norm_eps=1e-6,
                         tie_word_embeddings=True)
# HuggingFaceTB/SmolLM3-3B's config.json: 36 layers (every fourth without rotary), 16 query heads on
# 4 KV heads of 128, a 128256-token tied embedding
SMOLLM3_3B_SHAPE = dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
                        intermediate_size=11008, vocab_size=128256, max_position_embeddings=65536,
                        rope_theta=5000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                        use_sliding_window=False)
# allenai/OLMo-2-0425-1B's config.json: 16 layers of 16 heads of 128 (no GQA), norms after attention
# and the MLP, a 100352-token untied head
OLMO2_1B_SHAPE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                      intermediate_size=8192, vocab_size=100352, max_position_embeddings=4096, rope_theta=500000.0,
                      rms_norm_eps=1e-6, tie_word_embeddings=False)
SHAPES = {"smollm2-135m": ("LlamaConfig", SMOLLM2_SHAPE), "gemma3-270m": ("Gemma3TextConfig", GEMMA3_270M_SHAPE),
          "smollm3-3b": ("SmolLM3Config", SMOLLM3_3B_SHAPE), "olmo2-1b": ("Olmo2Config", OLMO2_1B_SHAPE)}


def random_shaped(path: str, shape: str = "smollm2-135m") -> str:
    """A random model of one of SHAPES (bf16) and a word-level tokenizer of its vocabulary
    size, written once to `path`."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    kind, dims = SHAPES[shape]
    config = getattr(transformers, kind)(**dims, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(dims["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w2", pad_token="w0").save_pretrained(path)
    return path


def make_workload(n: int, vocab: int, seed: int, min_prompt: int, max_prompt: int,
                  min_out: int, max_out: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(min_prompt, max_prompt))],
             rng.randint(min_out, max_out)) for _ in range(n)]


def start_decoding(llm, workload) -> None:
    """Add the workload's requests (greedy, ignore_eos) and step until every prompt has been
    read, so that the engine's next steps are pure decode steps."""
    from streamserve import SamplingParams

    for prompt, max_tokens in workload:
        llm._add_request(None, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    sched = llm.engine_core.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        llm.engine_core.step()


def run_streamserve(llm, workload) -> tuple[float, int]:
    from streamserve import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(m for _, m in workload)
    return elapsed, produced


def run_transformers(model, workload, batch_size: int) -> tuple[float, int]:
    """Static batches in arrival order: left-padded prompts, each batch runs to its
    longest output; only the tokens each request asked for are counted."""
    start = time.perf_counter()
    produced = 0
    for i in range(0, len(workload), batch_size):
        batch = workload[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        max_new = max(m for _, m in batch)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new,
                                 min_new_tokens=max_new, do_sample=False, pad_token_id=0)
        assert out.shape[1] == width + max_new
        produced += sum(m for _, m in batch)
    return time.perf_counter() - start, produced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory, .gguf file or alias such as "
                        "smollm2-135m-instruct (default: a random model of --shape)")
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES),
                        help="the random model's shape, without --model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the engine's (a long-context shape's own may not fit the KV cache)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--single-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--single-only", action="store_true", help="only the single-request run")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from streamserve import LLM

    model_path = args.model or random_shaped(
        os.path.join(os.path.expanduser("~/.cache/streamserve"), f"bench-{args.shape.split('-')[0]}-shape"),
        args.shape)
    llm = LLM(model_path, dtype=args.dtype, max_model_len=args.max_model_len)
    model_path = llm.config.model.model  # an alias or a GGUF resolves to a model directory
    vocab = llm.engine_core.vocab_size
    workload = make_workload(args.num_requests, vocab, args.seed, *args.prompt_len, *args.output_len)
    single = make_workload(1, vocab, args.seed + 1, 32, 32, args.single_tokens, args.single_tokens)
    run_streamserve(llm, make_workload(4, vocab, 99, 16, 64, 8, 8))  # warm-up

    results = {"model": model_path, "dtype": args.dtype, "threads": torch.get_num_threads()}
    t1, n1 = run_streamserve(llm, single)
    results["streamserve_single_tok_s"] = n1 / t1
    print(f"streamserve   single request: {n1 / t1:.1f} tok/s", flush=True)
    if not args.single_only:
        t, n = run_streamserve(llm, workload)
        results["streamserve_tok_s"] = n / t
        print(f"streamserve   workload: {n} tokens in {t:.1f} s = {n / t:.1f} tok/s", flush=True)
    del llm

    if not args.skip_transformers:
        dtype = getattr(torch, args.dtype)
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
        hf.generation_config.eos_token_id = None
        run_transformers(hf, make_workload(2, vocab, 99, 16, 64, 8, 8), 2)  # warm-up
        t1, n1 = run_transformers(hf, single, 1)
        results["transformers_single_tok_s"] = n1 / t1
        results["single_ratio"] = results["streamserve_single_tok_s"] / results["transformers_single_tok_s"]
        print(f"transformers  single request: {n1 / t1:.1f} tok/s "
              f"(streamserve / transformers: {results['single_ratio']:.2f}x)", flush=True)
        if not args.single_only:
            t, n = run_transformers(hf, workload, args.hf_batch_size)
            results["transformers_tok_s"] = n / t
            results["ratio"] = results["streamserve_tok_s"] / results["transformers_tok_s"]
            print(f"transformers  workload: {n} tokens in {t:.1f} s = {n / t:.1f} tok/s "
                  f"(streamserve / transformers: {results['ratio']:.2f}x)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
