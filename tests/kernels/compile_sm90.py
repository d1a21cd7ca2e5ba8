"""Compile every kernel for sm_90 (H100/H200) with Triton's own compiler, no GPU needed.

The interpreter runs the kernels' arithmetic on the CPU but accepts code the compiler refuses
(loop-carried types, returns, dot shapes); this catches that. Run as a script in a process
without TRITON_INTERPRET: `python tests/kernels/compile_sm90.py [bf16|fp32 ...]`.
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from streamserve_kernels import activation, attention, cache, gemv, norm, rotary, sampling  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(kernel, pointers: dict[str, str], constexprs: dict, num_warps: int = 4) -> None:
    """Pointer args get their element type, constexprs their value, any other arg is an i32."""
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32")
                 for name in kernel.arg_names}
    for name in ("qk_scale", "eps", "cap_log2e"):
        if name in signature:
            signature[name] = "fp32"
    triton.compile(ASTSource(kernel, signature, constexprs), target=TARGET, options={"num_warps": num_warps})


def compile_all(dt: str) -> None:
    precision = "ieee" if dt == "fp32" else "tf32"
    ptrs = {"out_ptr": f"*{dt}", "q_ptr": f"*{dt}", "k_cache_ptr": f"*{dt}", "v_cache_ptr": f"*{dt}",
            "block_tables_ptr": "*i64", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
            "part_ptr": "*fp32", "lse_ptr": "*fp32", "arrived_ptr": "*i32"}
    for softcap in (False, True):  # (Gemma 2's capped scores)
        compile_kernel(attention._paged_attention_kernel, ptrs, dict(
            GROUP=3, HEAD_DIM=64, HEAD_DIM_PAD=64, BLOCK_M=64, BLOCK_Q=21, BLOCK_SIZE=16, TILE_N=64,
            SOFTCAP=softcap, PRECISION=precision, UPCAST=False))
        for split in (True, False):
            compile_kernel(attention._decode_split_kernel, ptrs, dict(
                GROUP=3, HEAD_DIM=64, HEAD_DIM_PAD=64, BLOCK_M=16, BLOCK_SIZE=32, TILE_N=64, SPLIT=split,
                SOFTCAP=softcap, PRECISION=precision, UPCAST=False, PDL=split, GROUP_PAD=4, SPLITS_PAD=16))
    compile_kernel(cache._reshape_and_cache_kernel,
                   {"key_ptr": f"*{dt}", "value_ptr": f"*{dt}", "k_cache_ptr": f"*{dt}", "v_cache_ptr": f"*{dt}",
                    "slot_mapping_ptr": "*i64"},
                   dict(NUM_KV_HEADS=3, HEAD_DIM=64, HEADS_PAD=4, HEAD_DIM_PAD=64, BLOCK_SIZE=16), num_warps=1)
    for has_residual in (True, False):
        for weight_dt in {dt, "fp32"}:  # (a float32 weight: Gemma's norms, rounded once)
            ptrs = {n: f"*{dt}" for n in ("x_ptr", "residual_ptr", "out_ptr")}
            compile_kernel(norm._rms_norm_kernel, {**ptrs, "weight_ptr": f"*{weight_dt}"},
                           dict(HAS_RESIDUAL=has_residual, ROUND_NORMED=weight_dt != "fp32", BLOCK=1024,
                                PDL=has_residual))
    compile_kernel(rotary._rotary_kernel,
                   {"positions_ptr": "*i64", "q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "cache_ptr": f"*{dt}"},
                   dict(HALF=32, HALF_PAD=32, Q_HEADS_PAD=16, K_HEADS_PAD=4))
    compile_kernel(activation._silu_and_mul_kernel, {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}"}, dict(BLOCK=1024, PDL=True))
    for gated, normed, pdl in ((False, False, False), (False, False, True), (True, False, True), (False, True, True)):
        compile_kernel(gemv._gemv_kernel, {n: f"*{dt}" for n in ("x_ptr", "r_ptr", "nw_ptr", "new_r_ptr", "w_ptr",
                                                                  "bias_ptr", "out_ptr")},
                       dict(HAS_BIAS=not normed, GATED=gated, NORMED=normed, HAS_RESIDUAL=normed, ROUND_NORMED=normed,
                            EVEN=not gated, BLOCK_N=4, BLOCK_K=512, PDL=pdl))
    compile_kernel(sampling._argmax_blocks_kernel,
                   {"x_ptr": f"*{dt}", "value_ptr": "*fp32", "index_ptr": "*i32", "nan_ptr": "*i8"},
                   dict(BLOCK=4096), num_warps=8)
    compile_kernel(sampling._argmax_rows_kernel,
                   {"value_ptr": "*fp32", "index_ptr": "*i32", "nan_ptr": "*i8", "out_ptr": "*i64"},
                   dict(BLOCKS_PAD=32), num_warps=1)


if __name__ == "__main__":
    for dtype in sys.argv[1:] or ["bf16", "fp32"]:
        compile_all(dtype)
    print("compiled")
