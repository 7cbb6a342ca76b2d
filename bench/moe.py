"""Mixture-of-experts: the fused MoE layer against its references, and a Qwen3-30B-A3B-shaped
decode step.

Three parts (Qwen3-30B-A3B shapes by default: hidden 2048, 128 experts of width 768, top-8,
bf16, weights random and built in device memory):

- `layer`: the MoE block alone (router GEMM included) at 1, 16, 64, 512 and 8192 tokens:
  `cleave.kernels.fused_moe` (Triton), the torch reference, the reference under
  torch.compile, and transformers' own `Qwen3MoeSparseMoeBlock` on the same weights (the
  fused rows replayed from a CUDA graph, as a decode step runs them; up to
  `moe_gemv.MAX_TOKENS` tokens also the grouped GEMMs those sizes ran before, and the
  per-entry GEMVs routing inside their first kernel as the decode layout runs them: the
  "fused" row's route launch removed, an A/B in one run). Each
  row carries the fused result's largest difference from the reference, the experts the
  tokens touch, and the roofline: touched expert bytes / 4.26 TB/s.
- `decode`: one decode step of the whole model (48 layers, 32 q / 4 kv heads of 128) at
  batch 1 and 64 over a `--context`-token KV cache, captured in a CUDA graph and replayed.
  Its roofline counts every byte the step must read: attention and router weights, the
  touched experts (counted per layer from the routing of that very step), the KV cache, the
  embedding rows and lm_head. gpt-oss runs on the paired cache it is served with
  (`cleave.kv.groups`: its sliding layers over window tables holding only the pages in view).
- `prefill`: one `--prefill-tokens`-token prompt (8192 by default) through the whole model in
  one eager chunk, as a prefill worker runs it, last-token logits included: time and TFLOP/s
  on its active FLOPs (projections, router, the top-k experts per token, causal attention
  over the keys each query sees, the logits), against the H200's 790 TFLOP/s bf16 peak.

    python bench/moe.py                                  # both parts; bench/results/moe/
    python bench/moe.py --part layer --tokens 1,64,8192
    python bench/moe.py --part decode --batch 1,64 --context 2048
    python bench/moe.py --part prefill --prefill-tokens 2048,8192
    python bench/moe.py --part decode --model gpt-oss-20b --batch 1   # sinks, biases, 128-token windows
    python bench/moe.py --part decode --model gpt-oss-20b --packed-experts   # its MXFP4 experts kept packed
    python bench/moe.py --part decode --batch 1 --rotary-in-attention on,off   # q/k norms + rotary in attention or not
    python bench/moe.py --dry-run                        # tiny shapes on the CPU: checks the script

`--dry-run` runs every method once at toy sizes (the Triton kernels in the interpreter,
torch.compile skipped), so the script's wiring is tested without a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch

if TYPE_CHECKING:
    from cleave.kv.metadata import AttentionMetadata
    from cleave.model.config import ModelConfig

# A CPU dry run runs the Triton kernels in the interpreter, which triton reads when it is
# imported (below, through common) and when each kernel is decorated.
if __name__ == "__main__" and "--dry-run" in sys.argv[1:] and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    event_times_ms, format_table, graph_call_us, launch_label, median_ms, run_name, set_prefill_launch, write_results,
)
from decode_attention_binding import decode_attention_bound, require_calls  # noqa: E402

HBM_BYTES_PER_S = 4.26e12  # H200 device copy, read + write (bench/results/kernels)
LAYER_COLUMNS = ["tokens", "method", "us", "roofline_us", "roofline_pct", "touched_experts", "max_diff"]
DECODE_COLUMNS = ["batch", "context", "route", "attention", "router_tiles", "us", "roofline_us", "roofline_pct",
                  "touched_experts_per_layer", "bytes_gb"]
ROUTES = {  # --routes: where SparseMoeBlock routes in the GEMV decode layout
    "launch": {"route_in_gemv": False, "route_in_router": False},
    "in-gemv": {"route_in_gemv": True, "route_in_router": False},
    "in-router": {"route_in_gemv": False, "route_in_router": True},
}
ON_OFF = {"on": True, "off": False}  # --rotary-in-attention: Attention.rotary_in_decode_attention
PREFILL_COLUMNS = ["tokens", "launch", "ms", "active_tflop", "tflops", "peak_pct"]
PROFILE_COLUMNS = ["tokens", "what", "name", "calls", "us", "tflops", "critical_us"]
PEAK_FLOPS = 790e12  # H200 dense bf16


@dataclass(frozen=True)
class MoEShape:
    """The MoE block's shape (and, for the decode step, the rest of the model's)."""

    architecture: str = "qwen3-moe"  # or "gpt-oss": sinks, biases, clamped SwiGLU, alternating windows
    hidden: int = 2048
    inter: int = 768
    experts: int = 128
    top_k: int = 8
    layers: int = 48
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    vocab: int = 151936


TINY = MoEShape(hidden=64, inter=32, experts=8, top_k=2, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=512)
MODELS = {
    "qwen3-30b-a3b": MoEShape(),
    "gpt-oss-20b": MoEShape(architecture="gpt-oss", hidden=2880, inter=2880, experts=32, top_k=4, layers=24,
                            heads=64, kv_heads=8, head_dim=64, vocab=201088),
}
GPT_OSS_WINDOW = 128  # gpt-oss's sliding window, every other layer from the first


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("layer", "decode", "prefill", "all"), default="all")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b",
                        help="the shapes (the layer part's experts are SiLU without biases either way)")
    parser.add_argument("--tokens", default="1,16,64,512,8192", help="token counts of the layer part")
    parser.add_argument("--batch", default="1,64", help="batch sizes of the decode part")
    parser.add_argument("--prefill-tokens", default="8192", help="prompt lengths of the prefill part")
    parser.add_argument("--context", type=int, default=1024, help="tokens already in each sequence's KV cache")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gemv-tiles", default="",
                        help="layer part, up to moe_gemv.MAX_TOKENS tokens: also the per-entry GEMVs with these "
                        "features per program, GATE_UP:DOWN[:BLOCK_K[:WARPS]][,...] (e.g. 2:4,4:8:1024:8; the K tile "
                        "and warps of both kernels, default theirs; default tiles: the 'fused' row)")
    parser.add_argument("--packed-experts", action="store_true",
                        help="MXFP4 experts kept packed (as `--packed-experts` serves gpt-oss's): the layer part's "
                        "fused rows read them packed (random codes), the decode part is gpt-oss's only; the "
                        "roofline counts 4.25 bits a value")
    parser.add_argument("--routes", default="launch", help="decode part, comma-separated: where the GEMV layout "
                        "routes, 'launch' (its own), 'in-gemv' (the first expert GEMV: "
                        "SparseMoeBlock.route_in_gemv) and/or 'in-router' (the router GEMV's last program, "
                        "batch 1: SparseMoeBlock.route_in_router); the touched experts are counted with the "
                        "routing launch")
    parser.add_argument("--router-tiles", default="", help="decode part with --routes in-router, comma-separated "
                        "BLOCK_N:num_warps of the router GEMV that routes (SparseMoeBlock.router_tiles; "
                        "'default': moe_router.DEFAULT_TILES)")
    parser.add_argument("--rotary-in-attention", default="on", help="decode part, comma-separated 'on' and/or 'off': "
                        "whether the decode attention kernel applies the q/k norms, the rotary embedding and the KV "
                        "write (Attention.rotary_in_decode_attention) or kernels of their own do, before it")
    parser.add_argument("--decode-attention", nargs="*", default=[], type=json.loads,
                        help="decode part: JSON keyword arguments of paged_decode_attention (e.g. '{\"num_warps\": 4}'), "
                        "a row each after the default's, bound for the whole step (bench/decode_attention_binding.py)")
    parser.add_argument("--attention-launches", nargs="*", default=[], type=json.loads,
                        help="prefill part: JSON PrefillLaunch keyword arguments (cleave.kernels.attention_prefill) "
                        "over the layers' default launch, a row each after the default launch's, set on every "
                        "attention layer")
    parser.add_argument("--profile", action="store_true", help="prefill part: also profile the default launch at the "
                        "longest prompt (bench/step_profile.py: GEMMs by shape, kernels by name), written as "
                        "moe-prefill-profile-<time>")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile reference")
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers' MoE block")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "moe"))
    parser.add_argument("--name", default=None, help="results file stem (default: moe-<part>)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, one call per method")
    args = parser.parse_args(argv)
    args.tokens = [int(value) for value in args.tokens.split(",")]
    args.gemv_tiles = [tuple(int(n) for n in item.split(":")) for item in args.gemv_tiles.split(",") if item]
    if any(not 2 <= len(tiles) <= 4 for tiles in args.gemv_tiles):
        raise SystemExit("--gemv-tiles takes GATE_UP:DOWN[:BLOCK_K[:WARPS]] items")
    args.batch = [int(value) for value in args.batch.split(",")]
    args.prefill_tokens = [int(value) for value in args.prefill_tokens.split(",")]
    args.routes = [value for value in args.routes.split(",") if value]
    args.rotary_in_attention = [value for value in args.rotary_in_attention.split(",") if value]
    if not args.rotary_in_attention or set(args.rotary_in_attention) - set(ON_OFF):
        parser.error("--rotary-in-attention takes 'on', 'off' or 'on,off'")
    args.router_tiles = [None if item == "default" else tuple(int(n) for n in item.split(":"))
                         for item in args.router_tiles.split(",") if item] or [None]
    if not args.routes or set(args.routes) - set(ROUTES):
        parser.error(f"--routes takes a comma-separated subset of {', '.join(ROUTES)}")
    if args.dry_run:
        args.tokens = [min(value, 3) for value in args.tokens[:2]]
        args.batch = [min(value, 2) for value in args.batch[:2]]
        args.prefill_tokens = [min(value, 24) for value in args.prefill_tokens[:1]]
        args.context = min(args.context, 8)
        args.no_compile = True
    return args


class Timer:
    """Device time on the GPU (median over `rep_ms` of runs, L2 flushed); one wall-clock call
    on the CPU (dry run)."""

    def __init__(self, device: torch.device, warmup_ms: int = 10, rep_ms: int = 50) -> None:
        self.device, self.warmup_ms, self.rep_ms = device, warmup_ms, rep_ms

    def us(self, fn: Callable[[], object]) -> float:
        if self.device.type == "cuda":
            return median_ms(fn, self.warmup_ms, self.rep_ms) * 1e3
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6


def expert_bytes(shape: MoEShape, dtype: torch.dtype, packed: bool = False) -> int:
    """Bytes of one expert's three projections (packed MXFP4: half a byte a value and a
    scale byte per 32)."""
    values = 3 * shape.hidden * shape.inter
    return values // 2 + values // 32 if packed else values * torch.finfo(dtype).bits // 8


def layer_rows(args: argparse.Namespace, shape: MoEShape, device: torch.device, dtype: torch.dtype) -> list[dict]:
    from cleave.kernels.fused_moe import fused_experts, fused_moe, route
    from cleave.kernels.moe_gemv import MAX_TOKENS as GEMV_MAX_TOKENS
    from cleave.kernels.moe_gemv import down_depth_for, moe_gemv
    from cleave.kernels.moe_reference import SILU, fused_moe_reference

    generator = torch.Generator(device=device).manual_seed(0)
    if args.packed_experts:  # the fused rows read them packed; the baselines get them dequantised
        packed13 = packed_weight(shape.experts, 2 * shape.inter, shape.hidden, device, generator)
        packed2 = packed_weight(shape.experts, shape.hidden, shape.inter, device, generator)
        w13, w2 = packed13.dequantize(dtype), packed2.dequantize(dtype)
    else:
        w13 = torch.randn(shape.experts, 2 * shape.inter, shape.hidden, device=device, dtype=dtype, generator=generator)
        w13 *= shape.hidden**-0.5
        w2 = torch.randn(shape.experts, shape.hidden, shape.inter, device=device, dtype=dtype, generator=generator)
        w2 *= shape.inter**-0.5
        packed13, packed2 = w13, w2
    router = torch.randn(shape.experts, shape.hidden, device=device, dtype=dtype, generator=generator)
    router *= shape.hidden**-0.5
    hf_block = None if args.no_transformers else _transformers_block(shape, w13, w2, router)
    compiled = None if args.no_compile else torch.compile(fused_moe_reference)
    timer = Timer(device)
    rows = []
    for num_tokens in args.tokens:
        hidden = torch.randn(num_tokens, shape.hidden, device=device, dtype=dtype, generator=generator)
        impl = "triton"

        def fused() -> torch.Tensor:
            return fused_moe(hidden, packed13, packed2, hidden @ router.t(), shape.top_k, True, impl=impl)

        def reference() -> torch.Tensor:
            return fused_moe_reference(hidden, w13, w2, hidden @ router.t(), shape.top_k, True)

        def grouped() -> torch.Tensor:  # what `fused` ran at these sizes before the per-entry GEMVs
            weights, ids = route(hidden @ router.t(), shape.top_k, True, impl=impl)
            return fused_experts(hidden, packed13, packed2, weights, ids, impl=impl, kernel="grouped")

        def routed_gemv() -> torch.Tensor:  # the decode layout's form: `fused` without its routing launch
            return moe_gemv(hidden, packed13, packed2, None, None, SILU, router_logits=hidden @ router.t(),
                            top_k=shape.top_k, renormalize=True)

        other_depth = 3 - down_depth_for(num_tokens)  # `fused` with the down GEMV's other depth

        def down_other_depth() -> torch.Tensor:
            weights, ids = route(hidden @ router.t(), shape.top_k, True, impl=impl)
            return moe_gemv(hidden, packed13, packed2, weights, ids, SILU, down_depth=other_depth)

        def decode_layout() -> torch.Tensor:
            # as the GEMV decode layout launches it: routing of its own, PDL between the three
            weights, ids = route(hidden @ router.t(), shape.top_k, True, impl=impl, pdl=True)
            return moe_gemv(hidden, packed13, packed2, weights, ids, SILU, pdl=True)

        methods: dict[str, Callable[[], torch.Tensor]] = {"fused": fused}
        if num_tokens <= GEMV_MAX_TOKENS:  # next to "fused": its A/Bs
            methods["fused, routing in GEMV"] = routed_gemv
            methods[f"fused, down {'one tile' if other_depth == 1 else 'two tiles'} ahead"] = down_other_depth
            methods["decode layout (PDL)"] = decode_layout
        methods["reference"] = reference
        if num_tokens <= GEMV_MAX_TOKENS:
            methods["fused, grouped GEMMs"] = grouped
            for tiles in args.gemv_tiles:
                methods[f"fused, GEMV tiles {':'.join(map(str, tiles))}"] = gemv_with_tiles(
                    hidden, packed13, packed2, router, shape, *tiles)
        if compiled is not None:
            methods["reference+compile"] = lambda: compiled(hidden, w13, w2, hidden @ router.t(), shape.top_k, True)
        if hf_block is not None:
            methods["transformers"] = lambda: hf_block(hidden[None])[0]
        with torch.no_grad():
            expected = reference()
            _, ids = route(hidden @ router.t(), shape.top_k, True, impl="torch")
            touched = int(ids.unique().numel())
            roofline_us = touched * expert_bytes(shape, dtype, args.packed_experts) / HBM_BYTES_PER_S * 1e6
            for method, fn in methods.items():
                try:
                    out = fn()
                    # the fused layer as a decode step runs it: replayed from a CUDA graph
                    graphed = method.startswith("fused") and device.type == "cuda"
                    us = graph_call_us([fn]) if graphed else timer.us(fn)
                except Exception as error:  # noqa: BLE001 - a failed baseline is a row, not a crash
                    rows.append({"tokens": num_tokens, "method": method, "error": f"{type(error).__name__}: {error}"})
                    continue
                rows.append({
                    "tokens": num_tokens, "method": method, "us": us, "roofline_us": roofline_us,
                    "roofline_pct": 100 * roofline_us / us, "touched_experts": touched,
                    "max_diff": float((out.float() - expected.float()).abs().max()),
                })
    return rows


def packed_weight(experts: int, rows: int, columns: int, device: torch.device, generator: torch.Generator):  # noqa: ANN201
    """A random MXFP4Weight [experts, rows, columns]: every code, scales 2^-8..2^-5 (weights of
    a few hundredths, as a trained checkpoint's)."""
    from cleave.kernels.mxfp4 import MXFP4Weight

    blocks = torch.randint(0, 256, (experts, rows, columns // 2), device=device, dtype=torch.uint8, generator=generator)
    scales = torch.randint(119, 123, (experts, rows, columns // 32), device=device, dtype=torch.uint8,
                           generator=generator)
    return MXFP4Weight(blocks, scales)


def gemv_with_tiles(hidden, w13, w2, router, shape: MoEShape, gate_up_n: int, down_n: int,  # noqa: ANN001
                    block_k: int | None = None, warps: int | None = None):
    """The per-entry GEMV experts with `gate_up_n` / `down_n` features per program (and, where
    given, both kernels' K tile and warps)."""
    from cleave.kernels.fused_moe import route
    from cleave.kernels.moe_gemv import gemv_tiles, moe_gemv
    from cleave.kernels.moe_reference import SILU

    _, gate_up_k, gate_up_warps = gemv_tiles(shape.inter, shape.hidden, gated=True)
    _, down_k, down_warps = gemv_tiles(shape.hidden, shape.inter, gated=False)
    gate_up_k, down_k = block_k or gate_up_k, block_k or down_k
    gate_up_warps, down_warps = warps or gate_up_warps, warps or down_warps

    def run() -> torch.Tensor:
        weights, ids = route(hidden @ router.t(), shape.top_k, True)
        return moe_gemv(hidden, w13, w2, weights, ids, SILU, gate_up_tiles=(gate_up_n, gate_up_k, gate_up_warps),
                        down_tiles=(down_n, down_k, down_warps))

    return run


def _transformers_block(shape: MoEShape, w13: torch.Tensor, w2: torch.Tensor, router: torch.Tensor):
    """transformers' Qwen3MoeSparseMoeBlock holding the same weights (its stacked layout is ours)."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = transformers.Qwen3MoeConfig(
        hidden_size=shape.hidden, moe_intermediate_size=shape.inter, num_experts=shape.experts,
        num_experts_per_tok=shape.top_k, norm_topk_prob=True,
    )
    block = Qwen3MoeSparseMoeBlock(config).to(device=w13.device, dtype=w13.dtype).eval()
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(w13)
        block.experts.down_proj.copy_(w2)
        block.gate.weight.copy_(router)
    return block


def decode_model_config(shape: MoEShape, max_len: int, packed_experts: bool = False):
    """The model of `shape`; gpt-oss with `packed_experts` keeps its experts MXFP4."""
    from cleave.model.config import ModelConfig

    if packed_experts and shape.architecture != "gpt-oss":
        raise SystemExit("--packed-experts is for gpt-oss (the MXFP4 checkpoint)")

    if shape.architecture == "gpt-oss":  # as its config.json reads (bf16 experts: what cleave serves)
        return replace(ModelConfig.from_dict({
            "architectures": ["GptOssForCausalLM"], "vocab_size": shape.vocab, "hidden_size": shape.hidden,
            "intermediate_size": shape.inter, "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim, "num_local_experts": shape.experts,
            "num_experts_per_tok": shape.top_k, "sliding_window": GPT_OSS_WINDOW, "attention_bias": True,
            "swiglu_limit": 7.0, "rms_norm_eps": 1e-5, "max_position_embeddings": max_len, "dtype": "bfloat16",
            "rope_theta": 150000.0, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "original_max_position_embeddings": 4096},
            **({"quantization_config": {"quant_method": "mxfp4"}} if packed_experts else {}),
        }), packed_experts=packed_experts)
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=shape.vocab, hidden_size=shape.hidden,
        intermediate_size=6144, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, rope_theta=1000000.0,
        max_position_embeddings=max_len, qk_norm=True, dtype=torch.bfloat16, num_experts=shape.experts,
        num_experts_per_tok=shape.top_k, moe_intermediate_size=shape.inter, norm_topk_prob=True,
        moe_layers=tuple(range(shape.layers)),
    )


def random_model(config, dtype: torch.dtype, device: torch.device):  # noqa: ANN001, ANN201
    """The model of `config` with random weights (norms at 1) built in device memory; packed
    MXFP4 experts get random codes and scales 2^-8..2^-5 (weights of a few hundredths)."""
    from cleave.model.loader import empty_model

    model = empty_model(config, dtype=dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif param.dtype == torch.uint8:
                low, high = (119, 123) if name.endswith("_scales") else (0, 256)
                param.random_(low, high, generator=generator)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def decode_inputs(config: ModelConfig, batch: int, context: int, block_size: int, dtype: torch.dtype,
                  device: torch.device, generator: torch.Generator,
                  ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor, torch.Tensor]:
    """(kv_cache, metadata, input_ids, positions) of one decode step: `batch` sequences with
    `context` tokens cached each, the new token at position `context` (seq_len context + 1).

    The zeroed cache is [slots, 2, pages, block_size, kv_heads, head_dim] in the plan
    `kv_groups(config)` serves: one slot a layer, or gpt-oss's pairs, where each sequence's
    window table holds the pages in view and the null block 0 for those wholly behind the
    window. Sequence i's pages follow sequence i-1's; input_ids and positions are [batch].
    The metadata carries zeroed split counters, as the decode graphs' buffers do (without
    them every attention layer would allocate its own: a memset launch the engine's step
    does not have).
    """
    from cleave.kv.metadata import zeroed_split_counters
    from cleave.kv.groups import kv_groups
    from cleave.kv.metadata import AttentionMetadata
    from cleave.model.llama import allocate_kv_cache

    seq_len = context + 1
    blocks_per_seq = -(-seq_len // block_size)
    groups = kv_groups(config)
    tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(batch)]
    num_pages, window_tables = batch * blocks_per_seq + 1, None
    if groups.is_paired:
        assert groups.sliding_window is not None
        unseen = max(0, (context - groups.sliding_window + 1) // block_size)
        in_view = blocks_per_seq - unseen
        window_tables = [[0] * unseen + list(range(num_pages + i * in_view, num_pages + (i + 1) * in_view))
                         for i in range(batch)]
        num_pages += batch * in_view
    kv_cache = allocate_kv_cache(config, num_pages, block_size, dtype, device, num_slots=groups.num_slots)
    metadata = AttentionMetadata.build([1] * batch, [seq_len] * batch, tables, block_size, device=device,
                                       window_tables=window_tables)
    metadata.split_counters = zeroed_split_counters(batch, device)
    if metadata.window is not None:
        metadata.window.split_counters = metadata.split_counters
    input_ids = torch.randint(0, config.vocab_size, (batch,), device=device, generator=generator)
    positions = torch.full((batch,), context, device=device, dtype=torch.long)
    return kv_cache, metadata, input_ids, positions


def decode_rows(args: argparse.Namespace, shape: MoEShape, device: torch.device, dtype: torch.dtype) -> list[dict]:
    config = decode_model_config(shape, max(args.context + 1, 64), args.packed_experts)
    model = random_model(config, dtype, device)
    generator = torch.Generator(device=device).manual_seed(1)
    timer_device = device
    rows = []
    for batch in args.batch:
        kv_cache, metadata, input_ids, positions = decode_inputs(config, batch, args.context, args.block_size, dtype,
                                                                 device, generator)

        def step() -> torch.Tensor:
            return model.compute_logits(model(input_ids, positions, kv_cache, metadata))

        _set_moe_blocks(model, **ROUTES["launch"])  # the count hooks the routing launch
        touched = _touched_experts(model, step)
        windows = [config.layer_sliding_window(layer) for layer in range(config.num_hidden_layers)]
        num_bytes = _decode_bytes(shape, dtype, batch, args.context, touched, windows, args.packed_experts)
        roofline_us = num_bytes / HBM_BYTES_PER_S * 1e6
        # the router's tiles matter only where it routes
        routes = [(name, tiles) for name in args.routes
                  for tiles in (args.router_tiles if ROUTES[name]["route_in_router"] else [None])]
        for (route_name, router_tiles), rotary, attention in itertools.product(
                routes, args.rotary_in_attention, [{}, *args.decode_attention]):
            _set_moe_blocks(model, **ROUTES[route_name], router_tiles=router_tiles)
            for layer in model.layers:
                layer.self_attn.rotary_in_decode_attention = ON_OFF[rotary]
            with torch.no_grad(), decode_attention_bound(attention) as bound_calls:
                if timer_device.type == "cuda":
                    us = graph_call_us([step])  # captured with the setting bound
                else:
                    us = Timer(device).us(step)
            if attention:
                require_calls(bound_calls, attention)
            rows.append({
                "batch": batch, "context": args.context, "route": route_name, "rotary_in_attention": rotary,
                "attention": json.dumps(attention, sort_keys=True) if attention else "default",
                "router_tiles": "default" if router_tiles is None else "%d:%d" % router_tiles, "us": us,
                "roofline_us": roofline_us, "roofline_pct": 100 * roofline_us / us,
                "touched_experts_per_layer": sum(touched) / len(touched), "bytes_gb": num_bytes / 1e9,
            })
    return rows


def prefill_rows(args: argparse.Namespace, shape: MoEShape, device: torch.device,
                 dtype: torch.dtype) -> tuple[list[dict], list[dict]]:
    """One prompt of each `--prefill-tokens` length through the whole model (eager, in one
    chunk, as a prefill worker runs it), last-token logits included: time and TFLOP/s on the
    FLOPs of the experts it routes to (`active_flops`), with the default prefill attention
    launch and each of `--attention-launches`. With `--profile`, also the default launch's
    profile at the longest prompt (PROFILE_COLUMNS rows: its GEMMs, then its kernels)."""
    from cleave.kv.groups import kv_groups
    from cleave.kv.metadata import AttentionMetadata
    from cleave.model.llama import allocate_kv_cache

    config = decode_model_config(shape, max(args.prefill_tokens) + 1, args.packed_experts)
    model = random_model(config, dtype, device)
    groups = kv_groups(config)
    generator = torch.Generator(device=device).manual_seed(2)
    rows, profile = [], []
    for num_tokens in args.prefill_tokens:
        pages = -(-num_tokens // args.block_size)
        table = list(range(1, pages + 1))
        window_tables = [list(range(pages + 1, 2 * pages + 1))] if groups.is_paired else None
        kv_cache = allocate_kv_cache(config, 1 + pages * (2 if groups.is_paired else 1), args.block_size, dtype,
                                     device, num_slots=groups.num_slots)
        metadata = AttentionMetadata.build([num_tokens], [num_tokens], [table], args.block_size, device=device,
                                           window_tables=window_tables)
        input_ids = torch.randint(0, shape.vocab, (num_tokens,), device=device, generator=generator)
        positions = torch.arange(num_tokens, device=device)

        def step() -> torch.Tensor:
            return model.compute_logits(model(input_ids, positions, kv_cache, metadata)[-1:])

        flops = active_flops(shape, config, num_tokens)
        for launch in [{}, *args.attention_launches]:
            set_prefill_launch(model, launch)
            with torch.no_grad():
                if device.type == "cuda":
                    ms = sorted(event_times_ms(step, warmup=2, iters=5))[2]
                else:
                    ms = Timer(device).us(step) / 1e3
            rows.append({"tokens": num_tokens, "launch": launch_label(launch) if launch else "default",
                         "ms": ms, "active_tflop": flops / 1e12, "tflops": flops / (ms * 1e-3) / 1e12,
                         "peak_pct": 100 * flops / (ms * 1e-3) / PEAK_FLOPS})
        if args.profile and num_tokens == max(args.prefill_tokens):
            profile = prefill_profile(step, model, rows[-1 - len(args.attention_launches)]["ms"], num_tokens)
        del kv_cache
    return rows, profile


def prefill_profile(step: Callable[[], object], model, ms: float, num_tokens: int) -> list[dict]:  # noqa: ANN001
    """The default launch's prefill of `num_tokens`: its GEMMs by shape, then its kernels."""
    from step_profile import gemm_rows, kernel_rows

    set_prefill_launch(model, {})
    with torch.no_grad():
        gemms = [{"tokens": num_tokens, "what": "gemm", "name": row["shape"], "calls": row["calls"], "us": row["us"],
                  "tflops": row["tflops"]} for row in gemm_rows(step, PEAK_FLOPS / 1e12)]
        kernels = [{"tokens": num_tokens, "what": "kernel", "name": row["kernel"], "calls": row["launches"],
                    "us": row["us"], "critical_us": row["critical_us"]}
                   for row in (kernel_rows(step, ms * 1e3) if torch.cuda.is_available() else [])]
    return gemms + kernels


def active_flops(shape: MoEShape, config, num_tokens: int) -> float:  # noqa: ANN001
    """Matmul FLOPs of a `num_tokens` prefill on the experts each token routes to: the
    projections, router and top-k experts per token, causal attention (QK^T and PV over the
    keys each query sees: its window on gpt-oss's sliding layers), last-token logits."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_token = shape.hidden * (q + 2 * kv) + q * shape.hidden + shape.hidden * shape.experts \
        + shape.top_k * 3 * shape.hidden * shape.inter
    linear = 2.0 * shape.layers * per_token * num_tokens + 2.0 * shape.hidden * shape.vocab
    attention = 0.0
    for layer in range(shape.layers):
        window = config.layer_sliding_window(layer)
        keys = sum(min(t + 1, window or t + 1) for t in range(num_tokens)) if window else num_tokens * (num_tokens + 1) / 2
        attention += 4.0 * q * keys
    return linear + attention


def _set_moe_blocks(model, **settings: object) -> None:  # noqa: ANN001
    """Set these attributes of every MoE block (`ROUTES`' settings)."""
    from cleave.model.moe import SparseMoeBlock

    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            for name, value in settings.items():
                setattr(module, name, value)


def _touched_experts(model, step: Callable[[], torch.Tensor]) -> list[int]:
    """Distinct experts each MoE layer routes this step's tokens to (one eager run, hooked:
    the blocks' forwards, and the routing of the GEMV decode layout, which runs no forward)."""
    from cleave.kernels.fused_moe import route
    from cleave.model import fused_decode
    from cleave.model.moe import SparseMoeBlock

    counts: list[int] = []

    def record(module, args) -> None:  # noqa: ANN001
        # the block's own router logits (its forward may take the register GEMV, not router())
        router = module.router
        logits = torch.nn.functional.linear(args[0], router.weight, router.bias)
        _, ids = route(logits, module.top_k, module.renormalize, impl="torch")
        counts.append(int(ids.unique().numel()))

    def recorded_route(*args, **kwargs):  # noqa: ANN002, ANN003
        weights, ids = route(*args, **kwargs)
        counts.append(int(ids.unique().numel()))
        return weights, ids

    handles = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, SparseMoeBlock)]
    fused_decode.route = recorded_route
    try:
        with torch.no_grad():
            step()
    finally:
        fused_decode.route = route
        for handle in handles:
            handle.remove()
    if not counts:
        raise RuntimeError("no MoE layer routed during the step")
    return counts


def _decode_bytes(shape: MoEShape, dtype: torch.dtype, batch: int, context: int, touched: list[int],
                  windows: Sequence[int | None], packed_experts: bool = False) -> int:
    """Bytes one decode step must read: weights it uses, the KV cache (a sliding layer's
    window of it), embeddings, lm_head."""
    element = torch.finfo(dtype).bits // 8
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    attention = shape.hidden * (q + 2 * kv) + q * shape.hidden + 2 * shape.hidden + 2 * shape.head_dim
    router = shape.experts * shape.hidden
    weights = shape.layers * (attention + router) * element + sum(touched) * expert_bytes(shape, dtype, packed_experts)
    keys = sum(min(context + 1, window or context + 1) for window in windows)
    kv_cache = keys * batch * 2 * kv * element
    return weights + kv_cache + (batch + shape.vocab) * shape.hidden * element


def main(argv: Sequence[str] | None = None) -> dict[str, list[dict]]:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("bench/moe.py needs a CUDA device (or --dry-run for tiny shapes on the CPU)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = replace(TINY, architecture=MODELS[args.model].architecture) if args.dry_run else MODELS[args.model]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results: dict[str, list[dict]] = {}
    if args.part in ("layer", "all"):
        rows = layer_rows(args, shape, device, dtype)
        print(format_table(rows, LAYER_COLUMNS))
        write_results(args.out, run_name(f"{args.name or 'moe'}-layer"), rows, LAYER_COLUMNS, summary={"shape": asdict(shape)},
                      argv=["bench/moe.py", *(argv if argv is not None else sys.argv[1:])])
        results["layer"] = rows
    if args.part in ("prefill", "all"):
        rows, profile = prefill_rows(args, shape, device, dtype)
        print(format_table(rows, PREFILL_COLUMNS))
        write_results(args.out, run_name(f"{args.name or 'moe'}-prefill"), rows, PREFILL_COLUMNS,
                      summary={"shape": asdict(shape)}, argv=["bench/moe.py", *(argv if argv is not None else sys.argv[1:])])
        results["prefill"] = rows
        if args.profile:
            print(format_table(profile, PROFILE_COLUMNS))
            write_results(args.out, run_name(f"{args.name or 'moe'}-prefill-profile"), profile, PROFILE_COLUMNS,
                          summary={"shape": asdict(shape)},
                          argv=["bench/moe.py", *(argv if argv is not None else sys.argv[1:])])
            results["prefill_profile"] = profile
    if args.part in ("decode", "all"):
        rows = decode_rows(args, shape, device, dtype)
        print(format_table(rows, DECODE_COLUMNS))
        write_results(args.out, run_name(f"{args.name or 'moe'}-decode"), rows, DECODE_COLUMNS, summary={"shape": asdict(shape)},
                      argv=["bench/moe.py", *(argv if argv is not None else sys.argv[1:])])
        results["decode"] = rows
    return results


if __name__ == "__main__":
    main()
