"""One decode step's sampling alone: the torch exponential race against the one-kernel race.

For each `--batch` size, `Sampler.sample` over [B, V] fp32 logits (Llama-3's 128256 tokens)
at temperature `--temperature`, every row unseeded or every row seeded (`--seeded`), on the
torch path (`impl="torch"`: softmax, noise, clamp, division, argmax, each a pass over
[B, V]) and on the race kernel (`impl="triton"`, one pass; `cleave.kernels.race_sample`).
Reports device time per call (do_bench, L2 flushed), the host time a Python caller pays per
call, and the device time's share of one read of the logits at 4.26 TB/s.

    python bench/sampler.py --out bench/results/decode
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, host_call_us, median_ms, run_name, write_results  # noqa: E402

COLUMNS = ["batch", "rows", "path", "device_us", "host_us", "read_once_us", "read_once_pct"]
HBM_BYTES_PER_S = 4.26e12
PATHS = {"torch": "torch", "race kernel": "triton"}


def sampling_state(batch: int, vocab_size: int, temperature: float, seeded: bool, device: torch.device):  # noqa: ANN201
    from cleave.engine.sampling_tensors import SamplingTensors
    from cleave.generation.sampling_params import SamplingParams

    params = [SamplingParams(temperature=temperature, seed=row if seeded else None) for row in range(batch)]
    return SamplingTensors.from_params(params, vocab_size=vocab_size, device=device,
                                       output_token_ids=[[1, 2, 3]] * batch)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seeded", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--out", default=None, help="directory for sampler-<UTC time>.json / .md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from cleave.engine.sampler import Sampler

    device = torch.device("cuda")
    rows = []
    for batch in args.batch:
        logits = torch.randn(batch, args.vocab_size, device=device)
        read_once_us = batch * args.vocab_size * 4 / HBM_BYTES_PER_S * 1e6
        for seeded in args.seeded:
            state = sampling_state(batch, args.vocab_size, args.temperature, seeded == "on", device)
            for path, impl in PATHS.items():
                sampler = Sampler(seed=0, impl=impl)

                def call(sampler=sampler, state=state) -> torch.Tensor:
                    return sampler.sample(logits, state).token_ids

                device_us = median_ms(call) * 1e3
                rows.append({"batch": batch, "rows": "seeded" if seeded == "on" else "unseeded", "path": path,
                             "device_us": round(device_us, 1), "host_us": round(host_call_us(call), 1),
                             "read_once_us": round(read_once_us, 1),
                             "read_once_pct": round(100 * read_once_us / device_us, 1)})
                print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
    print(format_table(rows, COLUMNS))
    if args.out:
        write_results(args.out, run_name("sampler"), rows, COLUMNS,
                      {"vocab_size": args.vocab_size, "temperature": args.temperature})
    return 0


if __name__ == "__main__":
    sys.exit(main())
