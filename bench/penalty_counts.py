"""One step's penalty inputs for a batch of long penalised samples (CPU, host time): the
counts kept from step to step (`cleave.engine.penalty_counts`) against counting every row's
whole output afresh (`sampling_tensors.token_counts`, what a step did before).

For each `--batch` x `--outputs` case, every sequence has a presence penalty and `--outputs`
generated tokens; each timed step appends one token to every sequence and builds the step's
[B, V] counts both ways, in turns. The vocabulary is small (`--vocab`, 1024) so that the
[B, V] tensor work, which a GPU does on the device, stays small here and the table shows the
host's share: list flattening and index building, or the per-row bookkeeping.

    python bench/penalty_counts.py --out bench/results/penalty_counts
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, run_name, write_results  # noqa: E402

from cleave.engine.penalty_counts import PenaltyCounts  # noqa: E402
from cleave.engine.sampling_tensors import token_counts  # noqa: E402
from cleave.engine.sequence import Sequence  # noqa: E402
from cleave.generation.sampling_params import SamplingParams  # noqa: E402

COLUMNS = ["batch", "outputs", "vocab", "kept_ms", "recounted_ms", "ratio"]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="1x32768,8x16384,64x8192,256x1024", help="BATCHxOUTPUTS,...")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    params = SamplingParams(presence_penalty=0.5)
    rows = []
    for case in args.cases.split(","):
        batch, outputs = (int(value) for value in case.split("x"))
        seqs = [Sequence(f"r{i}", [rng.randrange(args.vocab) for _ in range(64)], sampling_params=params)
                for i in range(batch)]
        for seq in seqs:
            seq.all_token_ids += [rng.randrange(args.vocab) for _ in range(outputs)]
        table = PenaltyCounts(args.vocab, "cpu", max_rows=batch)
        table.gather(seqs, with_prompt=False)  # the sequences' first step counts their outputs so far
        kept = recounted = 0.0
        for _ in range(args.steps):
            for seq in seqs:
                seq.append_token(rng.randrange(args.vocab))
            start = time.perf_counter()
            counts, _ = table.gather(seqs, with_prompt=False)
            kept += time.perf_counter() - start
            start = time.perf_counter()
            fresh = token_counts([seq.output_token_ids for seq in seqs], args.vocab, "cpu")
            recounted += time.perf_counter() - start
            assert counts.equal(fresh)
        rows.append({"batch": batch, "outputs": outputs, "vocab": args.vocab,
                     "kept_ms": round(kept / args.steps * 1e3, 3), "recounted_ms": round(recounted / args.steps * 1e3, 3),
                     "ratio": round(recounted / kept, 1)})
        print(format_table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
    print(format_table(rows, COLUMNS))
    if args.out:
        write_results(args.out, run_name("penalty-counts"), rows, COLUMNS, summary={"steps": args.steps})
    return rows


if __name__ == "__main__":
    main()
