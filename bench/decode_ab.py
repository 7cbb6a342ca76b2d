"""Graph-replayed decode step, variants in turns: one process, one model, one KV cache.

Each variant captures its own `CUDAGraphRunner`; the rounds then time every variant's
back-to-back steps (device time per step, as `pipelined_ms` in bench/decode.py) one after
another, so drift of the machine over the run hits all of them alike. Variants:

- `copies`: inputs refilled by per-tensor `copy_`/`fill_` calls, rotary + KV write as
  their own kernel in batches on cuBLAS projections (the layout before the fused pieces);
- `fill`: inputs refilled by the one-launch kernel (cleave.kernels.decode_inputs);
- `fill_rotary`: that, and the rotary + KV write inside the decode attention kernel
  (and the logits below);
- `fill_rotary_cast`: that, with the logits of cuBLAS batches cast to fp32 by a separate
  pass (`lm_head(h).float()`) instead of written as fp32 by the GEMM;
- `fill_pdl_rotary`: `fill_rotary` with the input fill launched with PDL;
- `deferred_norms`: that, and batches above the GEMV path's size run without norm kernels:
  the norm weights are folded into the projections and the decode attention and SwiGLU
  kernels apply the per-row scale, the o and down GEMMs the residual adds (the default);
- `deferred_cublaslt`, `deferred_fp32_reduction`: that, with the GEMMs captured through
  cuBLASLt (`torch.backends.cuda.preferred_blas_library("cublaslt")`), or with bf16 GEMMs
  kept from reducing split-K partials in reduced precision
  (`allow_bf16_reduced_precision_reduction = False`); both change which kernels the BLAS
  heuristics pick.

The bench model's norm weights are ones, so folding them changes no weight and every variant
computes the same step.

    python bench/decode_ab.py --batches 1,64 --contexts 1024 --rounds 5 --out bench/results/decode/ab
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Iterator

import torch

from common import format_table, run_name, write_results
from decode import Case, decode_batch
from step_turns import build_step_bench, summary_row, time_in_turns

from cleave.kernels.gemv import AUTO_MAX_ROWS as GEMV_AUTO_MAX_ROWS

# name -> (fill impl, fill with PDL, rotary inside the decode attention kernel, logits by a
# cast pass, norms deferred to the attention and SwiGLU kernels)
VARIANTS = {
    "copies": ("torch", False, False, True, False),
    "fill": ("auto", False, False, True, False),
    "fill_rotary_cast": ("auto", False, True, True, False),
    "fill_rotary": ("auto", False, True, False, False),
    "fill_pdl_rotary": ("auto", True, True, False, False),
    "deferred_norms": ("auto", True, True, False, True),
    "deferred_cublaslt": ("auto", True, True, False, True),
    "deferred_fp32_reduction": ("auto", True, True, False, True),
}


@contextlib.contextmanager
def blas_setting(variant: str) -> Iterator[None]:
    """The BLAS library / reduction setting a variant's graphs are captured with."""
    library = torch.backends.cuda.preferred_blas_library()
    reduced = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    if variant == "deferred_cublaslt":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    if variant == "deferred_fp32_reduction":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(library)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced


COLUMNS = ["variant", "batch", "context", "median_us", "min_us", "max_us", "roofline_pct", "rounds_us"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--contexts", default="1024")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=32768, help="graph capacity")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=50, help="back-to-back steps per timing")
    parser.add_argument("--hbm-tbs", type=float, default=4.26)
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cases = [Case(int(b), int(c)) for c in args.contexts.split(",") for b in args.batches.split(",")]
    bench = build_step_bench(cases, args.block_size, args.max_model_len)
    model = bench.model

    def step_cast_logits(input_ids, positions, metadata):
        hidden = model(input_ids, positions, bench.kv_cache, metadata)
        if hidden.shape[0] <= GEMV_AUTO_MAX_ROWS:
            return model.compute_logits(hidden)
        return model.lm_head(hidden).float()

    names = args.variants.split(",")
    runners = {}
    with torch.inference_mode():
        for name in names:
            fill_impl, fill_pdl, rotary_in_attention, cast_logits, deferred_norms = VARIANTS[name]
            model.deferred_norm_decode = deferred_norms
            for layer in model.layers:
                layer.self_attn.rotary_in_decode_attention = rotary_in_attention
            with blas_setting(name):
                runner = bench.runner(step_cast_logits if cast_logits else bench.step,
                                      max(case.batch for case in cases))
            runner.buffers.fill = functools.partial(runner.buffers.fill, impl=fill_impl, pdl=fill_pdl)
            runners[name] = runner

        rows = []
        for case in cases:
            batch = decode_batch(case, args.block_size, bench.num_blocks, torch.device("cuda"),
                                 seed=case.batch + case.context)
            calls = [functools.partial(lambda runner: runner.run(*batch), runners[name]) for name in names]
            times = time_in_turns(calls, args.rounds, args.iters)
            for name, samples in zip(names, times):
                rows.append({"variant": name, "batch": case.batch, "context": case.context,
                             **summary_row(samples, bench.gb_read(case), args.hbm_tbs)})
                print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)

    summary = {"model": "Llama-3.2-1B shape, random bf16 weights", "weights_gb": round(bench.weight_bytes / 1e9, 3),
               "max_model_len": args.max_model_len, "iters": args.iters,
               "variants": {name: VARIANTS[name] for name in names}}
    print(format_table(rows, COLUMNS))
    if args.out:
        json_path, md_path = write_results(args.out, run_name("decode_ab"), rows, COLUMNS, summary)
        print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
