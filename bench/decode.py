"""Decode step benchmark: a Llama-3.2-1B-shaped model on a paged KV cache, eager vs CUDA graphs.

For each (batch, context) that fits in memory it times one decode step (every sequence at
`context` tokens, one new token each) eagerly and through `CUDAGraphRunner`, and reports
step time (median of CUDA-event timings of one synchronised step), tokens/s, kernels per
step, bytes read per step (weights + KV) and the fraction of the HBM roofline. It also
reports `pipelined_ms`: steps issued back to back without a sync in between, so the host's
input copies and graph launch overlap the previous step on the device, as in the engine's
overlapped loop; this is the device time per step. `host_us` is the host's time per call in
that loop (input copies, graph launch), which a synchronised step adds to the device's.

    python bench/decode.py --out bench/results/decode
    python bench/decode.py --no-pdl ...   # the same without programmatic dependent launch
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

import torch

from common import event_times_ms, format_table, run_name, write_results

from cleave.graphs.runner import CUDAGraphRunner, GraphRunnerConfig
from cleave.kv.metadata import AttentionMetadata
from cleave.model.config import ModelConfig
from cleave.model.llama import CausalLM, allocate_kv_cache

COLUMNS = ["mode", "batch", "context", "step_ms", "tokens_per_s", "kernels", "host_launches", "gb_read", "roofline_pct",
           "pipelined_ms", "pipelined_roofline_pct", "host_us"]
RESERVED_BYTES = 8 << 30  # activations, logits, graph pools, allocator slack


def llama_3_2_1b_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        dtype=torch.bfloat16,
    )


@dataclass(frozen=True)
class Case:
    """One measured point: `batch` sequences at `context` tokens each."""

    batch: int
    context: int

    def kv_blocks(self, block_size: int) -> int:
        return self.batch * -(-self.context // block_size)


def kv_bytes_per_token(config: ModelConfig) -> int:
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * config.dtype.itemsize


def weight_bytes_read(model: CausalLM) -> int:
    """Bytes of parameters a decode step streams: every matrix once (embedding rows are negligible)."""
    # named_parameters yields a tied embedding/lm_head matrix once; untied, the embedding
    # table is only gathered (B rows), so it is left out.
    total = 0
    for name, param in model.named_parameters():
        if name.startswith("embed_tokens") and not model.config.tie_word_embeddings:
            continue
        total += param.numel() * param.element_size()
    return total


def build_model(config: ModelConfig, device: torch.device, pdl: bool = True) -> CausalLM:
    with torch.device(device):
        model = CausalLM(config, pdl=pdl)
    model = model.to(config.dtype).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.02)
    return model.fold_norm_weights()  # as the serving engine does


def decode_batch(case: Case, block_size: int, num_blocks: int, device: torch.device, seed: int):
    """Inputs of one decode step on shuffled blocks 1..num_blocks-1 (block 0 is the null block)."""
    rng = random.Random(seed)
    blocks = list(range(1, num_blocks))
    rng.shuffle(blocks)
    per_seq = -(-case.context // block_size)
    tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(case.batch)]
    metadata = AttentionMetadata.build([1] * case.batch, [case.context] * case.batch, tables, block_size, device=device)
    input_ids = torch.randint(0, 128000, (case.batch,), device=device)
    positions = torch.full((case.batch,), case.context - 1, dtype=torch.int64, device=device)
    return input_ids, positions, metadata


def step_ms(fn, warmup: int, iters: int) -> float:
    """Median CUDA-event time of one call to fn, in milliseconds."""
    return statistics.median(event_times_ms(fn, warmup, iters))


def pipelined_ms(fn, warmup: int, iters: int, trials: int = 5) -> tuple[float, float]:
    """Medians over trials of (device milliseconds per step, host microseconds per call) of
    `iters` back-to-back calls with one sync at the end.

    The clock starts behind one untimed call already queued, so the device is busy from the
    first timed step on: the host's time to issue that first step (its input copies and graph
    launch, ~0.1 ms) is not spread over the timed ones.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per_step, host_us = [], []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        start.record()
        began = time.perf_counter()
        for _ in range(iters):
            fn()
        host_us.append((time.perf_counter() - began) / iters * 1e6)
        end.record()
        end.synchronize()
        per_step.append(start.elapsed_time(end) / iters)
    return statistics.median(per_step), statistics.median(host_us)


def count_launches(fn) -> tuple[int, int]:
    """(GPU kernels + memcpy/memset executed, host launch API calls) in one call of fn."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    device_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    host_calls = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CPU
        and e.name.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync"))
    ]
    return len(device_events), len(host_calls)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32,64,256", help="comma-separated batch sizes")
    parser.add_argument("--contexts", default="1024,32768", help="comma-separated context lengths (tokens)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None, help="graph capacity (default: largest context)")
    parser.add_argument("--hbm-tbs", type=float, default=4.26, help="HBM roofline in TB/s")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--no-graphs", action="store_true", help="measure eager mode only")
    parser.add_argument("--gemv-max-tokens", type=int, default=None,
                        help="batches up to this size take the fused GEMV path (default: the model's)")
    parser.add_argument("--no-pdl", dest="pdl", action="store_false",
                        help="launch no kernel with programmatic dependent launch (A/B against the default)")
    parser.add_argument("--out", default=None, help="directory for decode-<UTC time>.json / .md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode.py needs a CUDA device")
    device = torch.device("cuda")
    config = llama_3_2_1b_config()
    model = build_model(config, device, pdl=args.pdl)
    if args.gemv_max_tokens is not None:
        model.decode_gemv_max_tokens = args.gemv_max_tokens
    weights = weight_bytes_read(model)

    cases = [Case(int(b), int(c)) for c in args.contexts.split(",") for b in args.batches.split(",")]
    budget = torch.cuda.mem_get_info()[0] - RESERVED_BYTES
    block_bytes = args.block_size * kv_bytes_per_token(config)
    fitting = [case for case in cases if (case.kv_blocks(args.block_size) + 1) * block_bytes <= budget]
    skipped = [case for case in cases if case not in fitting]
    if not fitting:
        raise SystemExit("no (batch, context) case fits in GPU memory")
    num_blocks = max(case.kv_blocks(args.block_size) for case in fitting) + 1
    kv_cache = allocate_kv_cache(config, num_blocks, args.block_size, device=device)
    kv_cache.normal_(0.0, 1.0)

    def step(input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return model.compute_logits(model(input_ids, positions, kv_cache, metadata))

    max_model_len = args.max_model_len or max(case.context for case in fitting)
    runner = CUDAGraphRunner(
        step,
        GraphRunnerConfig(
            max_batch_size=max(case.batch for case in fitting),
            max_blocks_per_seq=-(-max_model_len // args.block_size),
            block_size=args.block_size,
            enabled=not args.no_graphs,
            pdl=args.pdl,
        ),
        device,
    )
    rows = []
    with torch.inference_mode():
        runner.capture()
        for case in fitting:
            batch = decode_batch(case, args.block_size, num_blocks, device, seed=case.batch + case.context)
            gb_read = (weights + case.batch * case.context * kv_bytes_per_token(config)) / 1e9
            modes = [("eager", lambda: step(*batch))] + ([] if args.no_graphs else [("graph", lambda: runner.run(*batch))])
            for mode, fn in modes:
                ms = step_ms(fn, args.warmup, args.iters)
                back_to_back, host_us = pipelined_ms(fn, args.warmup, args.iters)
                kernels, host_launches = count_launches(fn)
                rows.append(
                    {
                        "mode": mode,
                        "batch": case.batch,
                        "context": case.context,
                        "step_ms": round(ms, 4),
                        "tokens_per_s": round(case.batch / ms * 1e3, 1),
                        "kernels": kernels,
                        "host_launches": host_launches,
                        "gb_read": round(gb_read, 3),
                        "roofline_pct": round(100 * gb_read / (ms * 1e-3) / (args.hbm_tbs * 1e3), 1),
                        "pipelined_ms": round(back_to_back, 4),
                        "pipelined_roofline_pct": round(100 * gb_read / (back_to_back * 1e-3) / (args.hbm_tbs * 1e3), 1),
                        "host_us": round(host_us, 1),
                    }
                )
                print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)

    summary = {
        "model": "Llama-3.2-1B shape, random bf16 weights",
        "weights_gb": round(weights / 1e9, 3),
        "block_size": args.block_size,
        "max_model_len": max_model_len,
        "decode_gemv_max_tokens": model.decode_gemv_max_tokens,
        "pdl": args.pdl,
        "hbm_tbs": args.hbm_tbs,
        "skipped_no_memory": ", ".join(f"b{c.batch}/ctx{c.context}" for c in skipped) or "none",
    }
    print(format_table(rows, COLUMNS))
    print(summary)
    if args.out:
        json_path, md_path = write_results(args.out, run_name("decode"), rows, COLUMNS, summary)
        print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
