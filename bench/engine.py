"""End-to-end engine benchmark: a Llama-3.2-1B-shaped random bf16 checkpoint on one GPU.

Each phase runs in both step loops (`--modes`): `overlap` (the engine launches step N+1
before it processes step N's tokens; the CUDA default) and `sync` (the plain loop).

Phase 1 (throughput): `--num-requests` requests of `--prompt-len` random token ids, each
generating `--output-len` tokens (ignore_eos), submitted at once; reports output tokens/s
and the mean step-time breakdown by batch size.
Phase 2 (breakdown): `--breakdown-batch` requests at exactly that many running sequences.

Two measures of host overhead per row:
- `gpu_idle_pct` = 100 * (1 - sum(device_ms) / sum(step_ms)): `device_ms` is each step's
  forward + sampling time on the GPU (CUDA events around them, no synchronization) and
  `step_ms` the wall time of each `engine.step()` call, so this is the share of time the
  GPU had nothing to run because it waited for the host. It is the issue's host share for
  both loops (in the overlapped loop host work that runs while the GPU computes is free).
- `host_pct` = host-only phases (schedule, prepare, sampling prep, detokenize/outputs) over
  the step, only for the `breakdown (synced)` row: the sync loop with the device
  synchronized after the forward, so each phase's time is its own.

    python bench/engine.py --out bench/results/engine
    python bench/engine.py --num-requests 32 --output-len 128     # a quick run
    python bench/engine.py --penalised-share 0 0.1   # none, then a tenth of the requests, read their tokens on the host
    python bench/engine.py --modes overlap --attention-launches '{}' '{"decode_rows": false}'   # mixed steps' decodes
    python bench/engine.py --modes overlap --sampler-impls auto torch   # the one-kernel race vs torch ops
    python bench/engine.py --modes overlap --kv-cache-dtypes auto fp8   # the model's dtype vs an fp8 KV cache

Every Triton compile the run meets after start-up is counted per run (`compiles_in_run_*`,
`compile_s_in_run_*`) and listed with its step in the JSON (bench/compile_log.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/'s `common`, imported where used

COLUMNS = ["phase", "mode", "batch", "steps", "step_ms", "device_ms", "gpu_idle_pct", "schedule_ms", "prepare_ms",
           "forward_ms", "sample_ms", "sampling_prep_ms", "detokenize_ms", "host_pct", "graph_pct"]
MODES = ("overlap", "sync")

LLAMA_3_2_1B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=2048,
    intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
    hidden_act="silu", dtype="bfloat16", bos_token_id=0, eos_token_id=1,
)


TEXT_VOCAB = 512  # ids the tiny test tokenizer decodes


def write_checkpoint(directory: Path, device: str) -> Path:
    """Random bf16 Llama-3.2-1B-shaped weights (HF names) with the tiny test tokenizer."""
    import torch
    from safetensors.torch import save_file

    from cleave.testing.tiny_models import write_tiny_checkpoint

    tiny = write_tiny_checkpoint(directory / "tiny", "llama")
    model_dir = directory / "llama-1b"
    model_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, model_dir / name)
    cfg = LLAMA_3_2_1B
    hidden, inter, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"] * cfg["head_dim"]
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device=device) * 0.02).to(torch.bfloat16).cpu()

    # The tokenizer knows TEXT_VOCAB ids; lm_head rows past them are zero and the others
    # large enough (logit std ~10) that sampled ids decode to real text, so detokenization
    # costs what it costs on a real model. Llama-3.2-1B ties lm_head to the embedding; an
    # untied one reads the same bytes per step.
    lm_head = torch.zeros(cfg["vocab_size"], hidden, dtype=torch.bfloat16)
    lm_head[:TEXT_VOCAB] = randn(TEXT_VOCAB, hidden) * 11.0
    tensors = {"model.embed_tokens.weight": randn(cfg["vocab_size"], hidden), "lm_head.weight": lm_head,
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        tensors.update({
            prefix + "self_attn.q_proj.weight": randn(hidden, hidden),
            prefix + "self_attn.k_proj.weight": randn(kv, hidden),
            prefix + "self_attn.v_proj.weight": randn(kv, hidden),
            prefix + "self_attn.o_proj.weight": randn(hidden, hidden),
            prefix + "mlp.gate_proj.weight": randn(inter, hidden),
            prefix + "mlp.up_proj.weight": randn(inter, hidden),
            prefix + "mlp.down_proj.weight": randn(hidden, inter),
            prefix + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        })
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    return model_dir


def make_engine(
    model_dir: Path, args: argparse.Namespace, max_num_seqs: int, mode: str, sync_timing: bool = False,
    dtype: str = "bfloat16", num_blocks: int | None = None, stagger_reports: bool = True, kv_cache_dtype: str = "auto",
):
    """An engine for `mode`'s step loop, reporting outputs as `LLM.generate`'s does (every
    `BATCH_STREAM_INTERVAL` steps, ends at once; `stagger_reports`: each request on its own
    phase of them); `num_blocks` None sizes the KV cache from memory."""
    from cleave.engine.llm import BATCH_STREAM_INTERVAL, build_engine_config
    from cleave.engine.llm_engine import LLMEngine

    config = build_engine_config(
        model_dir, device=args.device, dtype=dtype, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        block_size=args.block_size, enforce_eager=args.enforce_eager, num_blocks=num_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, overlap_steps=mode == "overlap",
        stream_interval=BATCH_STREAM_INTERVAL, stagger_reports=stagger_reports, kv_cache_dtype=kv_cache_dtype,
    )
    return LLMEngine(config, sync_timing=sync_timing, device_timing=not sync_timing)


def run_requests(engine, num_requests: int, args: argparse.Namespace, seed: int, penalised_share: float = 0.0,
                 compile_log=None):  # type: ignore[no-untyped-def]
    """Submit every request, step to completion; returns (seconds, output tokens, per-step stats).
    `penalised_share` of the requests (spread evenly) carry a frequency penalty; a
    `compile_log` (bench/compile_log.py) has its label set to each step's index."""
    from cleave.engine.frozen_heap import frozen_heap
    from cleave.generation.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True)
    penalised = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True,
                               frequency_penalty=0.1)
    top_id = min(128000, engine.model_config.vocab_size)  # a tiny test model has a small vocabulary
    for index in range(num_requests):
        prompt = [rng.randrange(3, top_id) for _ in range(args.prompt_len)]  # feeds every embedding row
        # spread evenly: request i is penalised when the count of penalised requests steps up
        reads_outputs = int((index + 1) * penalised_share) > int(index * penalised_share)
        engine.add_request(f"b{seed}-{index}", prompt, penalised if reads_outputs else params)
    steps, num_output = [], 0
    start = time.perf_counter()
    with frozen_heap():  # as `LLM.generate` steps (and workers, which freeze at start-up)
        while engine.has_unfinished():
            if compile_log is not None:
                compile_log.label = len(steps)
            outputs = engine.step()
            num_output += sum(len(sample.token_ids) for output in outputs for sample in output.outputs)
            steps.append(engine.last_stats)
    return time.perf_counter() - start, num_output, steps


def summarize(phase: str, mode: str, label: str, steps: list, synced: bool = False) -> dict:
    def ms(field: str) -> float:
        return statistics.fmean(getattr(s, field) for s in steps) * 1e3

    wall_s = sum(s.wall_s for s in steps)
    device_s = sum(s.device_s for s in steps)
    host_pct = None
    if synced:  # phases are disjoint only when the device is synchronized inside the step
        host_pct = 100.0 * sum(s.host_s for s in steps) / sum(s.total_s for s in steps)
    return {
        "phase": phase, "mode": mode, "batch": label, "steps": len(steps), "step_ms": ms("wall_s"),
        "device_ms": ms("device_s") if device_s else None,
        "gpu_idle_pct": 100.0 * (1.0 - device_s / wall_s) if device_s else None,
        "schedule_ms": ms("schedule_s"), "prepare_ms": ms("prepare_s"), "forward_ms": ms("forward_s"),
        "sample_ms": ms("sample_s"), "sampling_prep_ms": ms("sampling_prep_s"), "detokenize_ms": ms("postprocess_s"),
        "host_pct": host_pct, "graph_pct": 100.0 * sum(s.used_graph for s in steps) / len(steps),
    }


STEP_LOG_FIELDS = ["seqs", "tokens", "wall_ms", "device_ms", "forward_ms", "postprocess_ms", "graph"]


def step_log(steps: list) -> list[list]:
    """Every step as STEP_LOG_FIELDS: the launched step's batch, its times, and whether its
    forward replayed a CUDA graph (1) or ran eagerly (0); in overlapped steps device and
    postprocess time belong to the step resolved, the one before. For the JSON: where a run's
    time went, step by step."""
    return [[s.num_seqs, s.num_tokens, round(s.wall_s * 1e3, 3), round(s.device_s * 1e3, 3),
             round(s.forward_s * 1e3, 3), round(s.postprocess_s * 1e3, 3), int(s.used_graph)] for s in steps]


def run_label(mode: str, penalised_share: float | None, launch: dict | None, sampler: str | None = None,
              kv_cache_dtype: str | None = None) -> str:
    """A throughput run's name: its step loop, then what it varies (None: not varied)."""
    from common import launch_label

    parts = [mode]
    if penalised_share is not None:
        parts.append(f"penalised {penalised_share:g}")
    if launch is not None:
        parts.append(f"attention {launch_label(launch) if launch else 'default'}")
    if sampler is not None:
        parts.append(f"sampler {sampler}")
    if kv_cache_dtype is not None:
        parts.append(f"kv {kv_cache_dtype}")
    return " ".join(parts)


def decode_steps(steps: list, lo: int, hi: int) -> list:
    return [s for s in steps if s.num_tokens == s.num_seqs and lo <= s.num_seqs <= hi]


def free_device_memory() -> None:
    """Return a dropped engine's KV cache and graph pools (reference cycles) to the device."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--max-model-len", type=int, default=None, help="default: prompt + output length")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--penalised-share", type=float, nargs="+", default=[0.0],
                        help="shares of requests with a frequency penalty (their sampling reads their tokens on the "
                        "host); several run in turn, each on a fresh engine, in the same run")
    parser.add_argument("--attention-launches", nargs="+", default=[{}], type=json.loads,
                        help="JSON PrefillLaunch keyword arguments (cleave.kernels.attention_prefill) over the layers' "
                        "default launch, set on every attention layer, '{}' the default; several run in turn, each on a fresh engine, in the same run")
    parser.add_argument("--sampler-impls", nargs="+", default=["auto"], choices=["torch", "auto"],
                        help="the sampler's path: 'auto' (the default: the one-kernel race on CUDA) or torch ops; "
                        "several run in turn, each on a fresh engine, in the same run")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], choices=["auto", "fp8"],
                        help="the KV cache's dtype: 'auto' (the model's) or 'fp8' (e4m3); several run in turn, each on "
                        "a fresh engine, in the same run")
    parser.add_argument("--breakdown-batch", type=int, default=64, help="0 skips phase 2")
    parser.add_argument("--breakdown-output-len", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--modes", default=",".join(MODES), help="step loops to run: overlap, sync or both")
    parser.add_argument("--out", default=None, help="directory for engine-<UTC time>.json / .md")
    args = parser.parse_args(argv)
    if args.max_model_len is None:
        args.max_model_len = args.prompt_len + max(args.output_len, args.breakdown_output_len)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from common import format_table, run_name, set_prefill_launch, write_results
    from compile_log import CompileLog

    from cleave.engine.sampler import Sampler

    modes = [mode for mode in args.modes.split(",") if mode]
    if not modes or set(modes) - set(MODES):
        raise SystemExit(f"--modes takes a comma-separated subset of {', '.join(MODES)}")
    rows, summary, details = [], {"modes": modes}, {}
    breakdown_len = args.breakdown_output_len
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        model_dir = write_checkpoint(Path(tmp), args.device)
        summary["checkpoint_s"] = round(time.perf_counter() - start, 1)
        shares, launches, samplers = args.penalised_share, args.attention_launches, args.sampler_impls
        kv_dtypes = args.kv_cache_dtypes
        summary.update(requests=args.num_requests, prompt_len=args.prompt_len, output_len=args.output_len,
                       penalised_share=shares, attention_launches=launches, sampler_impls=samplers,
                       kv_cache_dtypes=kv_dtypes)
        for mode, share, launch, sampler, kv_dtype in itertools.product(modes, shares, launches, samplers, kv_dtypes):
            label = run_label(mode, share if len(shares) > 1 else None, launch if len(launches) > 1 else None,
                              sampler if len(samplers) > 1 else None, kv_dtype if len(kv_dtypes) > 1 else None)
            start = time.perf_counter()
            with CompileLog() as compiles:
                compiles.label = "startup"
                engine = make_engine(model_dir, args, args.max_num_seqs, mode, kv_cache_dtype=kv_dtype)  # fresh each
                set_prefill_launch(engine.model, launch)
                engine.runner.sampler = Sampler(engine.config.seed, impl=sampler)
                summary[f"startup_s_{label}"] = round(time.perf_counter() - start, 1)
                summary[f"kv_blocks_{label}"] = engine.runner.num_blocks  # an fp8 cache holds twice the blocks
                seconds, num_output, steps = run_requests(engine, args.num_requests, args, seed=0,
                                                          penalised_share=share, compile_log=compiles)
            details[f"compiles_{label}"] = compiles.summary()
            in_run = [event for event in compiles.events if event.label != "startup"]
            summary[f"compiles_in_run_{label}"] = len(in_run)
            summary[f"compile_s_in_run_{label}"] = round(sum(event.seconds for event in in_run), 2)
            summary[f"seconds_{label}"] = round(seconds, 2)
            summary[f"output_tokens_per_s_{label}"] = round(num_output / seconds, 1)
            summary[f"steps_{label}"] = len(steps)
            summary[f"preemptions_{label}"] = engine.scheduler.stats.num_preemptions
            rows.append(summarize("throughput", label, "all", steps))
            for lo, hi in ((1, 32), (33, 96), (97, 192), (193, 4096)):
                selected = decode_steps(steps, lo, hi)
                if selected:
                    rows.append(summarize("throughput", label, f"decode {lo}-{hi}", selected))
            with_prompts = [s for s in steps if s.num_tokens > s.num_seqs]
            if with_prompts:
                rows.append(summarize("throughput", label, "with prompt tokens", with_prompts))
            details[f"step_log_{label}"] = step_log(steps)
            details["step_log_fields"] = STEP_LOG_FIELDS
            print(json.dumps(summary))
            print(format_table(rows, COLUMNS))
            for event in in_run[:12]:
                print(f"compile in step {event.label}: {event.kernel} {event.seconds * 1e3:.0f} ms {event.signature[:160]}")
            del engine
            free_device_memory()

        if args.breakdown_batch:
            batch = args.breakdown_batch
            breakdown_args = argparse.Namespace(**{**vars(args), "output_len": breakdown_len})
            runs = [(mode, False) for mode in modes] + ([("sync", True)] if "sync" in modes else [])
            for mode, synced in runs:
                engine = make_engine(model_dir, breakdown_args, batch, mode, sync_timing=synced)
                _, _, steps = run_requests(engine, batch, breakdown_args, seed=1, penalised_share=shares[0])
                selected = decode_steps(steps, batch, batch)
                del engine
                free_device_memory()
                if not selected:
                    continue
                phase = "breakdown (synced)" if synced else "breakdown"
                row = summarize(phase, mode, f"decode {batch}", selected, synced=synced)
                rows.append(row)
                if synced:
                    summary[f"host_pct_synced_at_batch_{batch}"] = round(row["host_pct"], 1)
                elif row["device_ms"] is not None:  # CUDA events (none on CPU)
                    summary[f"gpu_idle_pct_at_batch_{batch}_{mode}"] = round(row["gpu_idle_pct"], 1)
                    summary[f"step_ms_at_batch_{batch}_{mode}"] = round(row["step_ms"], 3)
                    summary[f"device_ms_at_batch_{batch}_{mode}"] = round(row["device_ms"], 3)

    print(json.dumps(summary))
    print(format_table(rows, COLUMNS))
    if args.out:
        write_results(args.out, run_name("engine"), rows, COLUMNS, summary=summary, details=details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
