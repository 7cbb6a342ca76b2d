"""Compile the decode-step, attention, KV write, fused MoE and sampling kernels for Hopper (sm_90) without a GPU;
run by test_hopper_compile.

Must run with TRITON_INTERPRET=0 (a fresh interpreter): under the interpreter `triton.jit`
functions cannot be compiled. Prints one line per compiled variant.
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
import triton.backends.nvidia
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cleave.kernels.activation import _gated_act_kernel
from cleave.kernels.attention_decode import _paged_decode_split_kernel
from cleave.kernels.attention_prefill import _paged_prefill_kernel
from cleave.kernels.decode_inputs import _fill_decode_inputs_kernel
from cleave.kernels.dispatch import unspecialised_params
from cleave.kernels.embedding import _embedding_kernel
from cleave.kernels.fused_moe import (
    _align_count_kernel,
    _align_offsets_kernel,
    _align_scatter_kernel,
    _moe_gemm_kernel,
    _route_kernel,
    _slot_sum_kernel,
)
from cleave.kernels.gemv import _gemv_kernel
from cleave.kernels.kv_write import _write_kv_kernel
from cleave.kernels.moe_gemv import _down_sum_kernel, _gate_up_kernel
from cleave.kernels.moe_router import _router_route_kernel
from cleave.kernels.moe_tiles import SHARED_MEMORY_BYTES
from cleave.kernels.rms_norm import _rms_norm_kernel
from cleave.kernels.splitk_linear import _splitk_linear_kernel
from cleave.kernels.race_sample import BLOCK_V, _race_kernel
from cleave.kernels.race_sample import MAX_SPLITS as RACE_MAX_SPLITS
from cleave.kernels.rotary_kv_write import _rotary_kv_write_kernel
from cleave.kernels.token_bitmask import _token_bitmask_kernel

TARGET = GPUTarget("cuda", 90, 32)
POINTERS = {  # argument name -> pointer type; every other runtime argument is an i32
    "x_ptr": "*bf16", "w_ptr": "*bf16", "norm_w_ptr": "*bf16", "out_ptr": "*bf16", "positions_ptr": "*i64",
    "cos_sin_ptr": "*fp32", "cache_ptr": "*bf16", "slot_mapping_ptr": "*i64", "query_ptr": "*bf16",
    "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "part_acc_ptr": "*fp32", "counters_ptr": "*i32",
    "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32",
    "part_ptr": "*fp32", "sumsq_ptr": "*fp32", "key_ptr": "*bf16", "value_ptr": "*bf16",
    "src_ids_ptr": "*i64", "src_positions_ptr": "*i64", "src_slots_ptr": "*i64", "src_seq_lens_ptr": "*i32",
    "src_tables_ptr": "*i32", "dst_ids_ptr": "*i64", "dst_positions_ptr": "*i64", "dst_slots_ptr": "*i64",
    "dst_seq_lens_ptr": "*i32", "dst_tables_ptr": "*i32", "ids_ptr": "*i64", "table_ptr": "*bf16",
    "residual_ptr": "*bf16", "weight_ptr": "*bf16", "norm_src_ptr": "*bf16", "sinks_ptr": "*fp32",
    "logits_ptr": "*bf16", "out_weights_ptr": "*fp32", "out_ids_ptr": "*i32", "topk_ids_ptr": "*i32",
    "counts_ptr": "*i32", "offsets_ptr": "*i32", "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32",
    "num_padded_ptr": "*i32", "a_ptr": "*bf16", "b_ptr": "*bf16", "bias_ptr": "*bf16", "c_ptr": "*bf16",
    "topk_weights_ptr": "*fp32", "q_norm_w_ptr": "*bf16", "k_norm_w_ptr": "*bf16", "inter_ptr": "*bf16",
    "weights_ptr": "*fp32", "scale_ptr": "*bf16",
}
FP8_CACHE = {"cache_ptr": "*fp8e4nv"}  # `--kv-cache-dtype fp8`: float8 e4m3 stores and loads
FEATURE_DIMS = {"N", "K", "num_in", "num_out", "hidden_size", "k_per_split"}  # runtime sizes that are multiples of 16 in every real model
FLOATS = {"eps", "scale_log2", "norm_eps", "alpha", "limit", "head_norm_eps"}


class VariantError(Exception):
    """A variant that would not launch as compiled (shared memory, spilled registers)."""


def compile_variant(kernel, constexprs: dict, num_warps: int, pointers: dict | None = None,
                    num_stages: int = 3) -> str:
    """Compile one variant; its line ("compiled ..."), or VariantError."""
    names = list(inspect.signature(kernel.fn).parameters)
    types = {**POINTERS, **(pointers or {})}
    signature = {
        name: "constexpr" if name in constexprs else types.get(name, "fp32" if name in FLOATS else "i32")
        for name in names
    }
    # pointers, strides and feature dimensions divisible by 16, as the JIT specialises them for
    # real shapes: masked loads vectorise and loops software-pipeline (async copies into
    # shared memory) only then, so shared memory and registers are those of a real launch;
    # not the arguments the kernel leaves unspecialised (counts that change step to step)
    unspecialised = unspecialised_params(kernel)
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if (signature[name].startswith("*") or name.startswith("stride") or name in FEATURE_DIMS)
               and i not in unspecialised}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, aligned), target=TARGET,
                              options={"num_warps": num_warps, "num_stages": num_stages})
    if compiled.metadata.shared > SHARED_MEMORY_BYTES:  # a launch would fail for lack of shared memory
        raise VariantError(f"{kernel.fn.__name__} {constexprs} needs {compiled.metadata.shared} bytes of shared memory")
    registers, spilled = resource_usage(compiled.asm["cubin"])
    if spilled:  # local memory: registers spilled to HBM in a kernel whose time is its bytes
        raise VariantError(f"{kernel.fn.__name__} {constexprs} spills {spilled} bytes ({registers} registers)")
    return f"compiled {kernel.fn.__name__} {constexprs} registers={registers}"


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, local-memory bytes per thread) of a compiled kernel, from the
    cuobjdump triton's NVIDIA backend ships."""
    tool = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                               check=True).stdout
    registers, local = re.search(r"REG:(\d+)", usage), re.search(r"LOCAL:(\d+)", usage)
    if registers is None or local is None:
        raise SystemExit(f"cuobjdump's resource usage did not parse: {usage[-500:]}")
    return int(registers.group(1)), int(local.group(1))


def variants() -> list[tuple[tuple, dict]]:
    """Every variant to compile: `compile_variant`'s arguments."""
    jobs: list[tuple[tuple, dict]] = []

    def compile_variant(*args, **kwargs) -> None:  # noqa: F811 (collects; compiled by `main`)
        jobs.append((args, kwargs))

    gemv = dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=2048, K_TILES=1, NORM=False, GATED=False, BIAS=False, ADD=False,
                ROTARY=False, IS_NEOX=True, HEAD_DIM=64, ROT_HALF=32, NUM_Q_HEADS=32, NUM_KV_HEADS=8, PDL=True,
                AHEAD=1)
    compile_variant(_gemv_kernel, {**gemv, "NORM": True, "ROTARY": True}, 4)  # qkv + rotary + KV write
    compile_variant(_gemv_kernel, {**gemv, "NORM": True, "ROTARY": True, "BIAS": True}, 4)  # gpt-oss's biased qkv
    compile_variant(_gemv_kernel, {**gemv, "NORM": True, "ROTARY": True}, 4, pointers=FP8_CACHE)  # into an fp8 cache
    compile_variant(_gemv_kernel, {**gemv, "ADD": True, "BIAS": True, "BLOCK_N": 8, "K_TILES": 2, "AHEAD": 2}, 8)  # biased o
    compile_variant(_gemv_kernel, {**gemv, "NORM": True, "GATED": True, "BLOCK_N": 2}, 4)  # gate_up
    compile_variant(_gemv_kernel, {**gemv, "ADD": True, "BLOCK_N": 8, "K_TILES": 4}, 8)  # down
    compile_variant(_gemv_kernel, {**gemv, "BLOCK_N": 8, "K_TILES": 2}, 8)  # gpt-oss's lm_head
    compile_variant(_gemv_kernel, {**gemv, "NORM": True, "BIAS": True, "BLOCK_N": 1, "K_TILES": 2}, 8)  # gpt-oss's router
    compile_variant(_gemv_kernel, {**gemv, "BLOCK_M": 4, "BLOCK_N": 2, "PDL": False}, 4)
    attention = dict(QUERIES_PER_KV=4, HEAD_DIM=64, NUM_SPLITS=16, SLIDING=False, BLOCK_G=16, BLOCK_N=64, BLOCK_D=64,
                     BLOCK_Q=4, BLOCK_S=16, DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", PREFETCH=True, ROTARY=False,
                     IS_NEOX=True, ROW_NORM=False, NORM_BLOCK=16, HEADS_FIRST=False, PDL=True, HAS_SINKS=False,
                     HEAD_NORM=False)
    compile_variant(_paged_decode_split_kernel, attention, 2)
    compile_variant(_paged_decode_split_kernel, {**attention, "NUM_SPLITS": 4, "PREFETCH": False, "SLIDING": True}, 2)
    compile_variant(_paged_decode_split_kernel, {**attention, "NUM_SPLITS": 2, "PREFETCH": False, "ROTARY": True}, 2)
    compile_variant(_paged_decode_split_kernel, {**attention, "NUM_SPLITS": 8, "ROTARY": True, "IS_NEOX": False}, 2)
    # the deferred input norm (norm weights folded into qkv), KV head fastest
    compile_variant(_paged_decode_split_kernel, {**attention, "NUM_SPLITS": 2, "PREFETCH": False, "ROTARY": True,
                                                 "ROW_NORM": True, "NORM_BLOCK": 1024, "HEADS_FIRST": True}, 2)
    # gpt-oss: attention sinks with a window, merged across splits and in one split
    compile_variant(_paged_decode_split_kernel, {**attention, "NUM_SPLITS": 4, "SLIDING": True, "ROTARY": True,
                                                 "HAS_SINKS": True}, 2)
    compile_variant(_paged_decode_split_kernel, {**attention, "NUM_SPLITS": 1, "HAS_SINKS": True}, 2)
    # Qwen3-30B-A3B: 8 query heads of 128 per KV head, q/k norms inside, 4 splits merged per chunk
    compile_variant(_paged_decode_split_kernel, {**attention, "QUERIES_PER_KV": 8, "HEAD_DIM": 128, "BLOCK_D": 128,
                                                 "BLOCK_Q": 8, "BLOCK_S": 4, "NUM_SPLITS": 32, "ROTARY": True,
                                                 "HEAD_NORM": True}, 2)
    # the same with four warps, which merge 8 splits a chunk
    compile_variant(_paged_decode_split_kernel, {**attention, "QUERIES_PER_KV": 8, "HEAD_DIM": 128, "BLOCK_D": 128,
                                                 "BLOCK_Q": 8, "BLOCK_S": 8, "NUM_SPLITS": 16, "ROTARY": True,
                                                 "HEAD_NORM": True}, 4)
    # an fp8 cache: tiles upcast to bf16 for the dots; the fused rotary writes the new K/V saturated
    compile_variant(_paged_decode_split_kernel, attention, 2, pointers=FP8_CACHE)
    compile_variant(_paged_decode_split_kernel, {**attention, "NUM_SPLITS": 2, "PREFETCH": False, "ROTARY": True,
                                                 "HEADS_FIRST": True}, 2, pointers=FP8_CACHE)
    compile_variant(_gated_act_kernel, dict(USE_GELU_TANH=False, BLOCK=1024, ROW_NORM=True, NORM_BLOCK=1024, PDL=True), 4)
    compile_variant(_fill_decode_inputs_kernel, dict(PAD_TOKEN=0, PAD_POSITION=0, PAD_SLOT=-1, PAD_SEQ_LEN=0,
                                                     NULL_BLOCK=0, BLOCK_W=1024, PDL=True), 4)
    compile_variant(_embedding_kernel, dict(BLOCK=2048, PDL=True), 8)
    compile_variant(_rms_norm_kernel, dict(HAS_RESIDUAL=False, ROWS=1, BLOCK_H=2048, PDL=True), 8)
    prefill = dict(QUERIES_PER_KV=4, HEAD_DIM=64, SLIDING=True, HAS_SINKS=False, BLOCK_M=64, BLOCK_N=64, BLOCK_D=64,
                   DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", GROUP=1, HEAVY_FIRST=False, CAUSAL_SPLIT=False)
    compile_variant(_paged_prefill_kernel, prefill, 4)
    compile_variant(_paged_prefill_kernel, {**prefill, "HAS_SINKS": True}, 4)
    # packed GQA heads, heavy blocks first, the unmasked walk below the diagonal (Llama-3.2-1B, Qwen3-30B-A3B)
    packed = {**prefill, "SLIDING": False, "BLOCK_M": 128, "GROUP": 4, "HEAVY_FIRST": True, "CAUSAL_SPLIT": True}
    compile_variant(_paged_prefill_kernel, packed, 8)
    compile_variant(_paged_prefill_kernel, {**packed, "QUERIES_PER_KV": 8, "GROUP": 8, "HEAD_DIM": 128,
                                            "BLOCK_D": 128}, 8)
    # the layers' tuned launches (`prefill_launch_for`): heads of 64 (Llama-3.2-1B; gpt-oss's, windowed
    # with sinks) on 8 warps, heads of 128 (Qwen3-30B-A3B) on 4
    tuned = {**prefill, "SLIDING": False, "BLOCK_M": 128, "HEAVY_FIRST": True, "CAUSAL_SPLIT": True}
    compile_variant(_paged_prefill_kernel, tuned, 8)
    compile_variant(_paged_prefill_kernel, {**tuned, "SLIDING": True, "HAS_SINKS": True, "QUERIES_PER_KV": 8}, 8)
    compile_variant(_paged_prefill_kernel, {**tuned, "QUERIES_PER_KV": 8, "HEAD_DIM": 128, "BLOCK_D": 128}, 4)
    compile_variant(_paged_prefill_kernel, prefill, 4, pointers=FP8_CACHE)
    compile_variant(_paged_prefill_kernel, packed, 8, pointers=FP8_CACHE)
    # the KV writes of prefill steps into an fp8 cache: plain, and fused with the rotary (Llama-3.2-1B)
    compile_variant(_write_kv_kernel, dict(NUM_KV_HEADS=8, HEAD_DIM=64, BLOCK_H=8, BLOCK_D=64), 4, pointers=FP8_CACHE)
    compile_variant(_rotary_kv_write_kernel, dict(HALF=32, BLOCK_HALF=32, Q_HEADS=32, KV_HEADS=8, BLOCK_D=64,
                                                  PARTIAL=False, IS_NEOX=True, HEAD_NORM=False, PDL=True), 4,
                    pointers={**FP8_CACHE, "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16"})
    # Qwen3-30B-A3B's prompt steps: its per-head q/k norms inside the rotary + KV write
    compile_variant(_rotary_kv_write_kernel, dict(HALF=64, BLOCK_HALF=64, Q_HEADS=32, KV_HEADS=4, BLOCK_D=128,
                                                  PARTIAL=False, IS_NEOX=True, HEAD_NORM=True, PDL=True), 4,
                    pointers={"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16"})
    # fused MoE (Qwen3-30B-A3B: 128 experts, top-8)
    route = dict(TOP_K=8, BLOCK_K=8, BLOCK_E=128, RENORMALIZE=True, PDL=True)
    compile_variant(_route_kernel, route, 1)
    # the router GEMV whose last program routes (`route_in_router`): Qwen3-30B-A3B's on one warp
    # and on four (four rows a program); gpt-oss-20b's (two K tiles, a bias)
    router = dict(BLOCK_N=1, BLOCK_K=2048, K_TILES=1, NORM=True, BIAS=False, TOP_K=8, BLOCK_TOPK=8, BLOCK_E=128,
                  RENORMALIZE=True, PDL=True)
    compile_variant(_router_route_kernel, router, 1)
    compile_variant(_router_route_kernel, {**router, "BLOCK_N": 4}, 4)
    compile_variant(_router_route_kernel, {**router, "K_TILES": 2, "BIAS": True, "TOP_K": 4, "BLOCK_TOPK": 4,
                                           "BLOCK_E": 32}, 1)
    compile_variant(_align_count_kernel, dict(BLOCK_E=128, BLOCK_T=64), 4)
    compile_variant(_align_offsets_kernel, dict(BLOCK_SIZE=64, BLOCK_E=128, BLOCK_P=64, BLOCK_T=64), 8)
    compile_variant(_align_scatter_kernel, dict(BLOCK_E=128, BLOCK_T=64), 4)
    moe = dict(ROW_DIV=8, GATED=True, CLAMPED=False, HAS_BIAS=False, MUL_WEIGHT=False, MXFP4=False, BLOCK_M=16,
               BLOCK_N=64, BLOCK_K=64, DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32")
    compile_variant(_moe_gemm_kernel, moe, 4)  # gate_up + SwiGLU
    compile_variant(_moe_gemm_kernel, {**moe, "CLAMPED": True, "HAS_BIAS": True, "BLOCK_M": 64}, 8)  # gpt-oss
    compile_variant(_moe_gemm_kernel, {**moe, "ROW_DIV": 1, "GATED": False, "MUL_WEIGHT": True}, 4)  # down, weighted
    compile_variant(_slot_sum_kernel, dict(TOP_K=8, BLOCK_H=1024), 4, pointers={"per_slot_ptr": "*bf16"})
    compile_variant(_slot_sum_kernel, dict(TOP_K=8, BLOCK_H=1024), 4, pointers={"per_slot_ptr": "*fp32"})
    # the largest tiles `bench/moe_tune.py` tries (prefill): they fit in shared memory
    compile_variant(_moe_gemm_kernel, {**moe, "BLOCK_M": 128, "BLOCK_N": 128}, 8, num_stages=4)
    compile_variant(_moe_gemm_kernel, {**moe, "ROW_DIV": 1, "GATED": False, "MUL_WEIGHT": True, "BLOCK_M": 128,
                                       "BLOCK_N": 256}, 8, num_stages=4)
    # gpt-oss's MXFP4 experts read packed (grouped GEMMs: gate_up with biases, weighted down)
    packed = {"b_ptr": "*u8", "scale_ptr": "*u8"}
    compile_variant(_moe_gemm_kernel, {**moe, "MXFP4": True, "CLAMPED": True, "HAS_BIAS": True, "BLOCK_M": 64}, 8,
                    pointers=packed)
    compile_variant(_moe_gemm_kernel, {**moe, "MXFP4": True, "ROW_DIV": 1, "GATED": False, "MUL_WEIGHT": True,
                                       "HAS_BIAS": True}, 4, pointers=packed)
    # per-entry expert GEMVs (decode): norm prologue, clamped SwiGLU with biases, residual add
    moe_ids = {"ids_ptr": "*i32"}
    gate_up = dict(TOP_K=8, BLOCK_N=2, BLOCK_K=2048, K_TILES=1, HAS_BIAS=False, CLAMPED=False, NORM=True, MXFP4=False,
                   ROUTE=False, BLOCK_TOPK=1, BLOCK_E=1, RENORMALIZE=False, PDL=True)
    compile_variant(_gate_up_kernel, gate_up, 4, pointers=moe_ids)
    # ... routing its token from the router logits (Qwen3-30B-A3B: 128 experts, top-8, hidden 2048)
    routed = dict(ROUTE=True, BLOCK_TOPK=8, BLOCK_E=128, RENORMALIZE=True)
    compile_variant(_gate_up_kernel, {**gate_up, **routed}, 4, pointers=moe_ids)
    compile_variant(_gate_up_kernel, {**gate_up, "TOP_K": 4, "K_TILES": 2, "HAS_BIAS": True, "CLAMPED": True,
                                      "NORM": False}, 4, pointers=moe_ids)
    # gpt-oss-20b's bf16 experts routing inside, the layer's norm in the prologue (`route_in_gemv`)
    compile_variant(_gate_up_kernel, {**gate_up, "TOP_K": 4, "K_TILES": 2, "HAS_BIAS": True, "CLAMPED": True,
                                      **routed, "BLOCK_TOPK": 4, "BLOCK_E": 32}, 4, pointers=moe_ids)
    down = dict(TOP_K=8, BLOCK_TOPK=8, BLOCK_N=8, BLOCK_K=1024, K_TILES=1, HAS_BIAS=False, ADD=True, MXFP4=False,
                DEPTH=2, PDL=True, EARLY=True)
    compile_variant(_down_sum_kernel, down, 4, pointers=moe_ids)
    compile_variant(_down_sum_kernel, {**down, "DEPTH": 1}, 4, pointers=moe_ids)
    compile_variant(_down_sum_kernel, {**down, "TOP_K": 4, "BLOCK_TOPK": 4, "K_TILES": 2, "HAS_BIAS": True,
                                       "ADD": False}, 4, pointers=moe_ids)
    # the same for gpt-oss-20b's MXFP4 experts (hidden and intermediate 2880: two K tiles)
    packed_gemv = {**moe_ids, "w_ptr": "*u8", "scale_ptr": "*u8"}
    compile_variant(_gate_up_kernel, {**gate_up, "TOP_K": 4, "K_TILES": 2, "HAS_BIAS": True, "CLAMPED": True,
                                      "MXFP4": True}, 4, pointers=packed_gemv)
    compile_variant(_gate_up_kernel, {**gate_up, "TOP_K": 4, "K_TILES": 2, "HAS_BIAS": True, "CLAMPED": True,
                                      "MXFP4": True, **routed, "BLOCK_TOPK": 4, "BLOCK_E": 32}, 4,
                    pointers=packed_gemv)  # routing over gpt-oss-20b's 32 experts, top-4
    compile_variant(_down_sum_kernel, {**down, "TOP_K": 4, "BLOCK_TOPK": 4, "BLOCK_K": 2048, "K_TILES": 2,
                                       "HAS_BIAS": True, "MXFP4": True}, 4, pointers=packed_gemv)
    splitk = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, NORM=True, GATED=False, ADD=False,
                  DOT_DTYPE=tl.bfloat16, DOT_PRECISION="tf32", PDL=True)
    compile_variant(_splitk_linear_kernel, splitk, 4)  # qkv with the input norm
    compile_variant(_splitk_linear_kernel, {**splitk, "GATED": True, "SPLIT_K": 2}, 4)  # gate_up
    compile_variant(_splitk_linear_kernel, {**splitk, "NORM": False, "ADD": True, "SPLIT_K": 1, "BLOCK_M": 32}, 4)
    # grammar-constrained decoding: one 4096-token block of bf16 logits per program, rows listed
    compile_variant(_token_bitmask_kernel, dict(HAS_ROWS=True, BLOCK_WORDS=128), 16,
                    pointers={"bitmask_ptr": "*i32", "rows_ptr": "*i64"})
    # sampling: the one-pass race over fp32 logits, its vocabulary split in chunks or not
    race = {"logits_ptr": "*fp32", "temperatures_ptr": "*fp32", "greedy_ptr": "*i1", "keys_ptr": "*i64",
            "part_score_ptr": "*fp32", "part_index_ptr": "*i32", "out_ptr": "*i64"}
    compile_variant(_race_kernel, dict(MAX_SPLITS=RACE_MAX_SPLITS, BLOCK_V=BLOCK_V), 8, pointers=race)
    return jobs


_VARIANTS: list[tuple[tuple, dict]] = []  # set by `main` before its pool forks


def _compile_nth(index: int) -> str:
    args, kwargs = _VARIANTS[index]
    try:
        return compile_variant(*args, **kwargs)
    except Exception as error:  # reported by the parent: a worker's exception may not pickle
        return f"FAILED {args[0].fn.__name__} {args[1]}: {type(error).__name__}: {error}"


def main() -> None:
    """Compile every variant on all cores (each compile is one process's work: the Triton
    front end, then ptxas), print a line each, and exit non-zero naming any that failed."""
    _VARIANTS[:] = variants()
    with multiprocessing.get_context("fork").Pool(os.cpu_count() or 1) as pool:
        lines = pool.map(_compile_nth, range(len(_VARIANTS)))
    for line in lines:
        print(line, flush=True)
    failed = [line for line in lines if line.startswith("FAILED")]
    if failed:
        raise SystemExit("\n".join(failed))


if __name__ == "__main__":
    main()
