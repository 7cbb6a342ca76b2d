"""Where one eager step that both decodes and prefills spends its device time, kernel by kernel.

The engine's throughput run (`bench/engine.py`: 256 requests of 512 prompt tokens, a
4096-token step budget) spends its first ~33 steps this way, each holding every request
already generating beside the rest of the budget as prompts, and those steps took about
59 ms each where 4096 prompt tokens alone would take about 20. This builds the same
Llama-3.2-1B-shaped model as `bench/decode.py` (random bf16 weights, folded norms), lays out
one such step per `--decodes` count as the scheduler does (`bench/attention_mixed.py`'s
`mixed_lengths`: the decodes first, contexts spread over [`--context` / 2, `--context`],
then fresh prompts of `--prompt-len` filling `--budget`), and profiles the step as the
engine runs it eagerly: the forward, the logits of the rows that sample, and the sampler
(temperature 1, unseeded). Per kernel: launches, device microseconds and the share of the
critical path (`bench/decode_profile.py`'s table), for each `--attention-launches` setting
and each `--sampler-impls` path.

    python bench/mixed_profile.py --out bench/results/prefill
    python bench/mixed_profile.py --decodes 0 248 --attention-launches '{"decode_rows": false}' '{}' \\
        --sampler-impls torch auto
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention_mixed import BLOCK_SIZE, mixed_lengths, shuffled_tables  # noqa: E402
from common import event_times_ms, format_table, launch_label, run_name, set_prefill_launch, write_results  # noqa: E402

COLUMNS = ["case", "kernel", "per_step", "us_per_step", "critical_us", "pct_of_step"]


def mixed_step_inputs(query_lens: list[int], seq_lens: list[int], vocab_size: int, device: torch.device, seed: int = 0):  # noqa: ANN201
    """(input_ids, positions, metadata, logits_rows, num_blocks) of one step: each sequence's
    new tokens are the last of its context, on shuffled blocks; every sequence samples from
    its last token."""
    from cleave.kv.metadata import AttentionMetadata

    rng = random.Random(seed)
    tables, num_blocks = shuffled_tables(seq_lens, rng)
    positions = [position for query_len, seq_len in zip(query_lens, seq_lens)
                 for position in range(seq_len - query_len, seq_len)]
    ends = [sum(query_lens[: index + 1]) - 1 for index in range(len(query_lens))]
    input_ids = torch.tensor([rng.randrange(vocab_size) for _ in positions], device=device)
    metadata = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE, device=device)
    return input_ids, torch.tensor(positions, device=device), metadata, torch.tensor(ends, device=device), num_blocks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decodes", type=int, nargs="+", default=[0, 128, 248])
    parser.add_argument("--context", type=int, default=1024, help="the longest decode's context")
    parser.add_argument("--budget", type=int, default=4096, help="tokens in the step (decodes + prompt tokens)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--attention-launches", nargs="+", default=[{"decode_rows": False}, {}], type=json.loads,
                        help="JSON PrefillLaunch keyword arguments, each profiled ('{}': the default launch)")
    parser.add_argument("--sampler-impls", nargs="+", default=["auto"], choices=["torch", "auto"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=14, help="kernels listed per case")
    parser.add_argument("--out", default=None, help="directory for mixed_profile-<UTC time>.json / .md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from decode import build_model, llama_3_2_1b_config
    from decode_profile import kernel_table

    from cleave.engine.sampler import Sampler
    from cleave.engine.sampling_tensors import SamplingTensors
    from cleave.generation.sampling_params import SamplingParams
    from cleave.model.llama import allocate_kv_cache

    device = torch.device("cuda")
    config = llama_3_2_1b_config()
    model = build_model(config, device)
    rows, summary = [], {"model": "Llama-3.2-1B shape, random bf16 weights", "budget": args.budget,
                         "prompt_len": args.prompt_len, "context": args.context}
    with torch.inference_mode():
        for decodes in args.decodes:
            query_lens, seq_lens = mixed_lengths(decodes, args.context, args.budget, args.prompt_len)
            input_ids, positions, metadata, logits_rows, num_blocks = mixed_step_inputs(
                query_lens, seq_lens, config.vocab_size, device)
            kv_cache = allocate_kv_cache(config, num_blocks, BLOCK_SIZE, device=device)
            kv_cache.normal_(0.0, 1.0)
            params = [SamplingParams(temperature=1.0)] * len(query_lens)
            state = SamplingTensors.from_params(params, vocab_size=config.vocab_size, device=device,
                                                output_token_ids=[[1]] * len(query_lens))
            for launch in args.attention_launches:
                set_prefill_launch(model, launch)
                for impl in args.sampler_impls:
                    sampler = Sampler(seed=0, impl=impl)

                    def step() -> torch.Tensor:
                        hidden = model(input_ids, positions, kv_cache, metadata)
                        logits = model.compute_logits(hidden.index_select(0, logits_rows))
                        return sampler.sample(logits, state).token_ids

                    label = (f"{decodes} decodes + {args.budget - decodes} prompt tokens, attention "
                             f"{launch_label(launch) if launch else 'default'}, sampler {impl}")
                    step_ms = sorted(event_times_ms(step, warmup=2, iters=7))[3]
                    table, kernel_us = kernel_table(step, args.steps)
                    summary[label] = {"step_ms": round(step_ms, 2), "kernel_ms": round(kernel_us / 1e3, 2),
                                      "kernels_per_step": round(sum(n for n, _, _ in table.values()), 1)}
                    print(label, summary[label], flush=True)
                    ranked = sorted(table.items(), key=lambda item: -item[1][2])[: args.top]
                    for name, (per_step, us, critical_us) in ranked:
                        rows.append({"case": label, "kernel": name, "per_step": round(per_step, 1),
                                     "us_per_step": round(us, 1), "critical_us": round(critical_us, 1),
                                     "pct_of_step": round(100 * us / (step_ms * 1e3), 1)})
                    print(format_table([row for row in rows if row["case"] == label], COLUMNS), flush=True)
            set_prefill_launch(model, {})
    if args.out:
        write_results(args.out, run_name("mixed_profile"), rows, COLUMNS, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
