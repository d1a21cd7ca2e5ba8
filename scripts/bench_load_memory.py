"""The memory a GGUF-converted model takes on the CPU, by --cpu-weights: peak and resident.

A random model of one of bench_throughput's shapes is laid out as a GGUF conversion is (the
default model's layout, models/quantized.py): random Q4_1 blocks for every linear weight but
the embedding, beside their values dequantized to bfloat16. Each --cpu-weights mode then
loads it in a process of its own, which prints its peak resident memory during the load
(ru_maxrss), its resident memory after it (VmRSS) and the bytes its weights, copies and blocks
hold.

    python scripts/bench_load_memory.py --shape olmo2-1b --cpu-weights copies quantized
    python scripts/bench_load_memory.py --shape olmo2-1b \
        --model ~/.cache/streamserve/bench-quant-olmo2-1b/group128/awq-4bit   # after bench_quantized.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

CHILD = """
import resource, sys
from streamserve import LLM
from bench_quantized import weight_bytes
llm = LLM(sys.argv[1], cpu_weights=sys.argv[2], kv_cache_memory="64MiB", max_model_len=256)
rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))
print(f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} {rss / 2**20:.2f} "
      f"{weight_bytes(llm) / 2**30:.2f}")
"""


def gguf_layout(src: str, dst: str) -> str:
    """`src` (a bfloat16 model) as a GGUF conversion with random Q4_1 blocks, written once."""
    import quantized_checkpoints as qc

    from streamserve.models.quantized import BLOCKS_FILE

    if os.path.isfile(os.path.join(dst, BLOCKS_FILE)):
        return dst
    return qc.write_gguf_layout(src, dst)


def main() -> None:
    from bench_throughput import SHAPES, random_shaped

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--cpu-weights", nargs="+", default=["copies", "quantized"],
                        choices=["auto", "quantized", "copies"])
    parser.add_argument("--model", help="load this model directory instead (e.g. one of bench_quantized.py's "
                                        "checkpoints)")
    args = parser.parse_args()
    root = os.path.join(os.path.expanduser("~/.cache/streamserve"), f"bench-quant-{args.shape}")
    path = args.model or gguf_layout(random_shaped(os.path.join(root, "bf16"), args.shape),
                                     os.path.join(root, "gguf-q4_1"))
    label = os.path.basename(path.rstrip("/")) if args.model else "Q4_1"
    for mode in args.cpu_weights:
        out = subprocess.run([sys.executable, "-c", CHILD, path, mode], capture_output=True, text=True, cwd=HERE,
                             env={**os.environ, "PYTHONPATH": HERE})
        if out.returncode:
            sys.exit(out.stderr[-2000:])
        peak, resident, held = out.stdout.split()[-3:]
        print(f"{args.shape} {label} --cpu-weights {mode}: load peak {peak} GiB, resident {resident} GiB, "
              f"weights hold {held} GiB", flush=True)


if __name__ == "__main__":
    main()
