"""Prefill benchmark: one long prompt through a Llama-3.2-1B-shaped model, cleave vs transformers.

Both models share the same random bf16 weights (transformers initialises them on the GPU,
cleave loads its state dict), so the script also reports how far the two last-token logits
are apart. Time is the median of CUDA-event timings after warm-up; TFLOP/s counts the
linear layers (2 * params * tokens, lm_head for the last token only) plus causal attention
(QK^T and PV over the lower triangle: 2 * 2 * T^2 / 2 * Hq * D per layer).

    python bench/prefill.py --out bench/results/prefill.json   # writes prefill-<UTC time>.json
    python bench/prefill.py --out bench/results/prefill/prefill.json --skip-hf \
        --attention-launches '{"pack_gqa": true}' '{"dense_fresh": true}'
    python bench/prefill.py --out bench/results/prefill/prefill.json --tokens 32768 --chunk 2048 --skip-hf

`--chunk` prefills the prompt as a chunked engine does: steps of that many tokens, each after
the ones before it in the cache (transformers still takes the prompt in one pass).

`--profile` adds where the default cleave prefill's time goes (bench/step_profile.py): its
GEMMs by shape with their TFLOP/s, and its kernels by name with their time on the critical
path. `--attention-launches` adds a cleave row per setting (JSON keyword arguments of
`cleave.kernels.attention_prefill.PrefillLaunch` over each layer's default launch, set on
every layer), timed in the same run as the default launch's row.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

COLUMNS = ["name", "median_ms", "min_ms", "tflops", "pct_of_peak"]

LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "prefill" / "prefill.json",
                        help="JSON results path; the run writes STEM-<UTC time>.json beside it")
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length (one sequence)")
    parser.add_argument("--chunk", type=int, default=0,
                        help="cleave prefills the prompt in steps of this many tokens, each after the cached ones "
                        "(as an engine with max_num_batched_tokens = CHUNK does); 0: one step")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 matmul peak of the device")
    parser.add_argument("--skip-hf", action="store_true", help="time cleave only")
    parser.add_argument("--compiled", action="store_true", help="also time cleave under torch.compile")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attention-launches", nargs="*", default=[], type=json.loads,
                        help="JSON PrefillLaunch keyword arguments over the layers' default launch, one cleave row "
                        "each (the default launch first)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile the default cleave prefill: its GEMMs by shape and its kernels by name")
    return parser.parse_args(argv)


def prefill_steps(num_tokens: int, chunk: int, block_table: list[int], block_size: int, device):  # noqa: ANN001, ANN201
    """(start, end, AttentionMetadata) of each step that prefills a `num_tokens` prompt on
    `block_table`, `chunk` tokens a step after the ones cached before them (0: one step)."""
    from cleave.kv.metadata import AttentionMetadata

    size = chunk or num_tokens
    steps = []
    for start in range(0, num_tokens, size):
        end = min(num_tokens, start + size)
        steps.append((start, end, AttentionMetadata.build([end - start], [end], [block_table], block_size,
                                                          device=device)))
    return steps


def prefill_flops(config, num_tokens: int) -> float:
    """FLOPs of one prefill forward plus last-token logits (see the module docstring)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    layer_params = hidden * (config.q_size + 2 * config.kv_size) + config.q_size * hidden + 3 * hidden * inter
    linear = 2.0 * config.num_hidden_layers * layer_params * num_tokens + 2.0 * hidden * config.vocab_size
    attention = 2.0 * num_tokens * num_tokens * config.q_size * config.num_hidden_layers
    return linear + attention


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import transformers
    from common import event_times_ms, format_table, launch_label, machine_info, run_path, set_prefill_launch

    from cleave.model.compiled import compile_model
    from cleave.model.config import ModelConfig
    from cleave.model.llama import allocate_kv_cache
    from cleave.model.loader import empty_model, load_hf_state_dict

    if not torch.cuda.is_available():
        print("bench/prefill.py needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(args.seed)
    hf_config = transformers.LlamaConfig(**{k: v for k, v in LLAMA_3_2_1B.items() if k != "architectures"})
    config = ModelConfig.from_dict({**LLAMA_3_2_1B, "dtype": "bfloat16"})

    with torch.device(device):
        hf_model = transformers.AutoModelForCausalLM.from_config(
            hf_config, dtype=torch.bfloat16, attn_implementation="sdpa"
        ).eval()
    model = load_hf_state_dict(empty_model(config, torch.bfloat16, device), hf_model.state_dict())

    num_tokens, block_size = args.tokens, args.block_size
    num_blocks = (num_tokens + block_size - 1) // block_size
    generator = torch.Generator().manual_seed(args.seed)
    block_table = torch.randperm(num_blocks + 64, generator=generator)[:num_blocks].tolist()  # scattered blocks
    kv_cache = allocate_kv_cache(config, num_blocks + 64, block_size, torch.bfloat16, device)
    input_ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=generator).to(device)
    positions = torch.arange(num_tokens, device=device)
    steps = prefill_steps(num_tokens, args.chunk, block_table, block_size, device)

    def cleave_step(lm=model) -> torch.Tensor:
        for start, end, metadata in steps:
            hidden = lm(input_ids[start:end], positions[start:end], kv_cache, metadata)  # [chunk, H]
        return lm.compute_logits(hidden[-1:])  # [1, V]

    def hf_step() -> torch.Tensor:
        return hf_model(input_ids[None], logits_to_keep=1, use_cache=False).logits[0].float()  # [1, V]

    flops = prefill_flops(config, num_tokens)
    rows: list[dict[str, object]] = []

    def record(name: str, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.inference_mode():
            times = event_times_ms(step, args.warmup, args.iters)
            logits = step()
        median_ms = statistics.median(times)
        tflops = flops / (median_ms * 1e-3) / 1e12
        rows.append({
            "name": name,
            "median_ms": round(median_ms, 3),
            "min_ms": round(min(times), 3),
            "tflops": round(tflops, 1),
            "pct_of_peak": round(100 * tflops / args.peak_tflops, 1),
            "times_ms": [round(t, 3) for t in times],
        })
        return logits

    cleave_logits = record("cleave", cleave_step)
    profile: dict[str, object] = {}
    if args.profile:
        from step_profile import GEMM_COLUMNS, KERNEL_COLUMNS, gemm_rows, kernel_rows

        with torch.inference_mode():
            profile = {"gemms": gemm_rows(cleave_step, args.peak_tflops),
                       "kernels": kernel_rows(cleave_step, rows[0]["median_ms"] * 1e3)}
        print(format_table(profile["gemms"], GEMM_COLUMNS))
        print(format_table(profile["kernels"], KERNEL_COLUMNS))
    for launch in args.attention_launches:
        set_prefill_launch(model, launch)
        record(f"cleave {launch_label(launch)}", cleave_step)
    set_prefill_launch(model, {})
    comparison: dict[str, object] = {}
    if not args.skip_hf:
        hf_logits = record("transformers-sdpa", hf_step)
        comparison = {
            "last_token_logits_max_abs_diff": (cleave_logits - hf_logits).abs().max().item(),
            "last_token_argmax_equal": bool(cleave_logits.argmax() == hf_logits.argmax()),
        }
    if args.compiled:
        compiled = compile_model(empty_model(config, torch.bfloat16, device))
        load_hf_state_dict(compiled, hf_model.state_dict())
        record("cleave-torch.compile", lambda: cleave_step(compiled))

    chunking = f" in steps of {args.chunk} (transformers: one)" if args.chunk else ""
    print(f"prefill of {num_tokens} tokens{chunking}, {flops / 1e12:.2f} TFLOP, peak {args.peak_tflops:.0f} TFLOP/s")
    print(format_table(rows, COLUMNS))
    for key, value in comparison.items():
        print(f"{key}: {value}")

    result = {
        "benchmark": "prefill",
        "command": shlex.join(["python", "bench/prefill.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": asdict(machine_info()),
        "transformers": transformers.__version__,
        "model_shape": "Llama-3.2-1B (random bf16 weights)",
        "num_tokens": num_tokens,
        "chunk": args.chunk,
        "block_size": block_size,
        "flops": flops,
        "peak_tflops": args.peak_tflops,
        "results": rows,
        "comparison": comparison,
        "profile": profile,
    }
    out = run_path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
