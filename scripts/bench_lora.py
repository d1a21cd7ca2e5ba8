"""What a LoRA adapter costs a step: decode throughput of the same batch through the model
alone, through one adapter, and half and half, in one process, rounds alternating.

    python scripts/bench_lora.py [--model DIR] [--rank 16] [--batch 1 16] [--tokens 64] [--rounds 3]

The adapter is random (PEFT's layout, every projection of every layer, rank --rank): its
cost does not depend on its values. The model's own steps of up to a few hundred tokens run
in one C call on the CPU; a step that holds an adapter's request runs op by op, with two
small GEMMs per adapted layer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import save_file

from streamserve import LLM, LoRARequest, SamplingParams


def write_adapter(llm: LLM, path: str, rank: int) -> str:
    model = llm.engine_core.model_runner.model
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for module, target in model.lora_targets().items():
        if module.endswith(("qkv_proj", "gate_up_proj")):  # the pieces instead, as PEFT names them
            continue
        tensors[f"base_model.model.model.{module}.lora_A.weight"] = torch.randn(rank, target.in_features, generator=gen) * 0.01
        tensors[f"base_model.model.model.{module}.lora_B.weight"] = torch.randn(target.rows, rank, generator=gen) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                   "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}, f)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(args.model, enable_lora=True, max_lora_rank=max(64, args.rank))
    adapter = LoRARequest("bench", 1, write_adapter(llm, tempfile.mkdtemp(prefix="bench-lora-"), args.rank))
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    prompt = list(range(1000, 1064))
    for batch in args.batch:
        prompts = [{"prompt_token_ids": [batch * 7 + i] + prompt} for i in range(batch)]
        plans = {"model alone": None, "all through the adapter": adapter}
        if batch > 1:
            plans["half through it"] = [adapter if i % 2 else None for i in range(batch)]
        llm.generate(prompts, params, use_tqdm=False, lora_request=adapter)  # warm up both paths
        llm.generate(prompts, params, use_tqdm=False)
        rates: dict[str, list[float]] = {name: [] for name in plans}
        for _ in range(args.rounds):
            for name, plan in plans.items():
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False, lora_request=plan)
                rates[name].append(batch * args.tokens / (time.perf_counter() - start))
        base = statistics.median(rates["model alone"])
        for name, values in rates.items():
            rate = statistics.median(values)
            print(f"batch {batch:3d}  {name:24s} {rate:7.1f} tok/s (median of {args.rounds}; "
                  f"{rate / base:.2f}x the model alone)")


if __name__ == "__main__":
    main()
