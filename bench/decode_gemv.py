"""Decode projections: the register GEMV (1-4 rows) or the split-K kernel (more rows) vs the
tensor-core GEMV vs cuBLAS.

Two measurements on the Llama-3.2-1B projections, both inside CUDA graphs over 16 layers'
worth of distinct weights (so every call streams its weight from HBM, not L2):

- `sweep`: each projection alone (16 back-to-back calls of one shape), over the register
  GEMV's tile settings (up to 4 rows) or the split-K kernel's (more rows), to pick their
  defaults, beside cuBLAS and the tensor-core GEMV;
- `chain`: the projections of 16 decoder layers in step order (qkv with the input norm, o
  added into the residual, gate_up with the post-attention norm and SwiGLU, down added into
  the residual), which is where programmatic dependent launch lets one projection's weight
  stream start under the previous one's tail.

Bytes are the weights read; the roofline is bytes / 4.26 TB/s.

With `--model gpt-oss-20b` only the sweep runs, over that model's dense projections (qkv and
lm_head read 2880-wide rows: a 2048-wide K tile leaves the second tile 40% full) and the
register GEMV's K tiles (`WIDE_SWEEP`); its layers are mixture-of-experts (bench/moe.py).

    python bench/decode_gemv.py --rows 1 --out bench/results/decode
    python bench/decode_gemv.py --rows 64 --out bench/results/decode
    python bench/decode_gemv.py --model gpt-oss-20b --out bench/results/decode
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, graph_call_us, run_name, write_results  # noqa: E402

from cleave.kernels.activation import silu_and_mul  # noqa: E402
from cleave.kernels.gemv import MAX_ROWS as GEMV_MAX_ROWS  # noqa: E402
from cleave.kernels.rms_norm import rms_norm  # noqa: E402
from cleave.kernels.small_linear import small_linear  # noqa: E402

COLUMNS = ["measure", "shape", "rows", "impl", "block_n", "block_k", "split_k", "num_stages", "num_warps", "pdl", "us",
           "roofline_pct"]
HIDDEN, INTERMEDIATE, QKV = 2048, 8192, 3072
SHAPES = {"qkv": (QKV, HIDDEN, False), "o": (HIDDEN, HIDDEN, False), "gate_up": (INTERMEDIATE, HIDDEN, True),
          "down": (HIDDEN, INTERMEDIATE, False)}
SWEEP = {  # (block_n, block_k) tried per shape
    "qkv": [(4, 2048), (8, 2048)],
    "o": [(2, 2048), (4, 2048)],
    "gate_up": [(1, 2048), (2, 2048), (4, 2048)],
    "down": [(4, 2048), (8, 2048), (4, 4096)],
    "lm_head": [(4, 2048), (8, 2048), (16, 2048)],
}
LM_HEAD = (128256, HIDDEN, False)  # swept alone (not part of the layer chain)
# split-K kernel settings tried per shape above 4 rows: (block_n, block_k, split_k, num_stages)
SWEEP_SPLITK = [(block_n, block_k, split_k, stages) for block_n in (32, 64) for block_k in (64, 128)
                for split_k in (1, 2, 4, 8) for stages in ((3, 4) if block_k == 64 else (3,))]
# the fusions each projection carries in a decode step
FUSIONS = {"qkv": "norm", "o": "add", "gate_up": "norm", "down": "add"}
# gpt-oss-20b's dense projections (N, K) at one row, each over its layers' distinct weights,
# and the register GEMV settings (block_n, block_k, num_warps) tried on each; None: its default
GPT_OSS_SHAPES = {"qkv": (5120, 2880, 24), "o": (2880, 4096, 24), "lm_head": (201088, 2880, 2)}
WIDE_SWEEP = [None, (8, 1024, 8), (8, 1024, 4), (4, 1024, 4), (16, 1024, 8), (8, 512, 4), (4, 4096, 8),
              (2, 4096, 4), (16, 2048, 8)]


def make_layers(num_layers: int) -> list[dict[str, torch.Tensor]]:
    def weight(num_out: int, num_in: int) -> torch.Tensor:
        return torch.randn(num_out, num_in, device="cuda", dtype=torch.bfloat16) * 0.02

    return [{
        "qkv": weight(QKV, HIDDEN), "o": weight(HIDDEN, HIDDEN), "gate_up": weight(2 * INTERMEDIATE, HIDDEN),
        "down": weight(HIDDEN, INTERMEDIATE),
        "norm1": torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16),
        "norm2": torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16),
    } for _ in range(num_layers)]


def weight_bytes(name: str) -> int:
    num_out, num_in, gated = SHAPES.get(name, LM_HEAD)
    return num_out * num_in * 2 * (2 if gated else 1)


def chain_calls(layers, residual: torch.Tensor, settings: dict[str, dict], cublas: bool = False):
    """One callable per layer: the four projections in step order."""

    def layer_call(layer):
        def run() -> None:
            if cublas:  # cuBLAS GEMMs with the norms and SwiGLU as separate kernels
                qkv = F.linear(rms_norm(residual, layer["norm1"], 1e-5), layer["qkv"])
                residual.add_(F.linear(qkv[:, :HIDDEN], layer["o"]))
                act = silu_and_mul(F.linear(rms_norm(residual, layer["norm2"], 1e-5), layer["gate_up"]))
                residual.add_(F.linear(act, layer["down"]))
                return
            qkv = small_linear(residual, layer["qkv"], norm_weight=layer["norm1"], **settings["qkv"])
            small_linear(qkv[:, :HIDDEN], layer["o"], add_to=residual, **settings["o"])
            act = small_linear(residual, layer["gate_up"], gated=True, norm_weight=layer["norm2"], **settings["gate_up"])
            small_linear(act, layer["down"], add_to=residual, **settings["down"])
        return run

    return [layer_call(layer) for layer in layers]


def sweep_splitk(layers, rows: int, record) -> dict[str, tuple[float, dict]]:
    """Each projection alone with its step fusions: cuBLAS (+ the unfused ops), the tensor-core
    GEMV, then the split-K kernel over SWEEP_SPLITK. Returns the best split-K settings per shape."""
    best: dict[str, tuple[float, dict]] = {}
    counters = torch.zeros(4096, dtype=torch.int32, device="cuda")
    for name, (num_out, num_in, gated) in SHAPES.items():
        x = torch.randn(rows, num_in, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn(rows, num_out, device="cuda", dtype=torch.bfloat16)
        norm = layers[0]["norm1"]
        weights = [layer[name] for layer in layers]

        def call(w, **settings):
            if FUSIONS[name] == "add":
                return small_linear(x, w, add_to=residual, **settings)
            return small_linear(x, w, gated=gated, norm_weight=norm, **settings)

        def cublas(w):
            if FUSIONS[name] == "add":
                return residual.add_(F.linear(x, w))
            out = F.linear(rms_norm(x, norm, 1e-5), w)
            return silu_and_mul(out) if gated else out

        record("sweep", name, rows, "cublas", graph_call_us([lambda w=w: cublas(w) for w in weights]),
               weight_bytes(name))
        record("sweep", name, rows, "dot", graph_call_us([lambda w=w: call(w, kernel="dot") for w in weights]),
               weight_bytes(name))
        for block_n, block_k, split_k, stages in SWEEP_SPLITK:
            settings = dict(kernel="splitk", block_n=block_n, block_k=block_k, split_k=split_k, num_stages=stages,
                            counters=counters)
            us = graph_call_us([lambda w=w: call(w, **settings) for w in weights])
            record("sweep", name, rows, "splitk", us, weight_bytes(name), block_n=block_n, block_k=block_k,
                   split_k=split_k, num_stages=stages)
            if name not in best or us < best[name][0]:
                best[name] = (us, settings)
    return best


def sweep_gpt_oss(record) -> None:
    """gpt-oss-20b's dense projections alone at one row over `WIDE_SWEEP`, beside cuBLAS."""
    from cleave.kernels.gemv import gemv_tiles

    for name, (num_out, num_in, num_layers) in GPT_OSS_SHAPES.items():
        weights = [torch.randn(num_out, num_in, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(num_layers)]
        x = torch.randn(1, num_in, device="cuda", dtype=torch.bfloat16)
        nbytes = num_out * num_in * 2
        record("sweep", name, 1, "cublas", graph_call_us([lambda w=w: F.linear(x, w) for w in weights]), nbytes)
        for tiles in WIDE_SWEEP:
            block_n, block_k, warps = tiles or gemv_tiles(1, num_out, num_in, gated=False)
            settings = dict(kernel="fma", block_n=block_n, block_k=block_k, num_warps=warps)
            us = graph_call_us([lambda w=w: small_linear(x, w, **settings) for w in weights])
            record("sweep", name, 1, "fma" if tiles else "fma (default)", us, nbytes, block_n=block_n,
                   block_k=block_k, num_warps=warps)
        del weights


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("llama-3.2-1b", "gpt-oss-20b"), default="llama-3.2-1b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--num-warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--hbm-tbs", type=float, default=4.26)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    results: list[dict] = []

    def record(measure: str, shape: str, rows: int, impl: str, us: float, nbytes: int, **settings) -> None:
        results.append({"measure": measure, "shape": shape, "rows": rows, "impl": impl, **settings, "us": round(us, 2),
                        "roofline_pct": round(100 * nbytes / (us * 1e-6) / (args.hbm_tbs * 1e12), 1)})
        print(format_table(results[-1:], COLUMNS).splitlines()[-1], flush=True)

    if args.model == "gpt-oss-20b":
        sweep_gpt_oss(record)
        print(format_table(results, COLUMNS))
        if args.out:
            write_results(args.out, run_name("decode_gemv"), results, COLUMNS)
        return
    layers = make_layers(args.layers)

    for rows in args.rows:
        best: dict[str, tuple[float, dict]] = {}
        if not args.skip_sweep and rows > GEMV_MAX_ROWS:
            best = sweep_splitk(layers, rows, record)
        elif not args.skip_sweep:
            lm_head = torch.randn(LM_HEAD[0], HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
            for name, (num_out, num_in, gated) in [*SHAPES.items(), ("lm_head", LM_HEAD)]:
                x = torch.randn(rows, num_in, device="cuda", dtype=torch.bfloat16)
                weights = [layer[name] for layer in layers] if name in SHAPES else [lm_head] * 4
                if name == "lm_head":
                    us = graph_call_us([lambda w=w: F.linear(x, w) for w in weights])
                    record("sweep", name, rows, "cublas", us, weight_bytes(name))
                else:
                    us = graph_call_us([lambda w=w: small_linear(x, w, gated=gated, kernel="dot") for w in weights])
                    record("sweep", name, rows, "dot", us, weight_bytes(name))
                for block_n, block_k in SWEEP[name]:
                    if triton.next_power_of_2(rows) * block_n * block_k > 32768:
                        continue  # the [rows, features, K] products would spill
                    for warps in args.num_warps:
                        settings = dict(kernel="fma", block_n=block_n, block_k=block_k, num_warps=warps)
                        us = graph_call_us([lambda w=w: small_linear(x, w, gated=gated, **settings) for w in weights])
                        record("sweep", name, rows, "fma", us, weight_bytes(name), block_n=block_n, block_k=block_k,
                               num_warps=warps)
                        if name not in best or us < best[name][0]:
                            best[name] = (us, settings)

        residual = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        counters = torch.zeros(4096, dtype=torch.int32, device="cuda")
        step_bytes = args.layers * sum(weight_bytes(name) for name in SHAPES)
        variants = {
            "dot": {name: {"kernel": "dot"} for name in SHAPES},
            "splitk": {name: {"kernel": "splitk", "counters": counters} for name in SHAPES},
            "fma": {name: {"kernel": "fma"} for name in SHAPES},
            "fma_no_pdl": {name: {"kernel": "fma", "pdl": False} for name in SHAPES},
            "dot_no_pdl": {name: {"kernel": "dot", "pdl": False} for name in SHAPES},
        }
        if rows > GEMV_MAX_ROWS:
            del variants["fma"], variants["fma_no_pdl"]
        else:
            del variants["splitk"]
        if best:
            variants["best"] = {name: settings for name, (_, settings) in best.items() if name in SHAPES}
        for impl, settings in variants.items():
            us = graph_call_us(chain_calls(layers, residual, settings)) * args.layers
            record("chain", "layers", rows, impl, us, step_bytes, pdl="no_pdl" not in impl)
        us = graph_call_us(chain_calls(layers, residual, {}, cublas=True)) * args.layers
        record("chain", "layers", rows, "cublas", us, step_bytes)
        if best:
            print("best per shape:", {name: {key: value for key, value in settings.items() if key != "counters"}
                                      for name, (_, settings) in best.items()}, flush=True)

    print(format_table(results, COLUMNS))
    if args.out:
        write_results(args.out, run_name("decode_gemv"), results, COLUMNS)


if __name__ == "__main__":
    main()
