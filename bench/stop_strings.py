"""Stop-string checking per token: the mean and the worst token, on streams built to hold long
tails back (CPU, one thread).

A sample's `StopChecker` holds back output that could still become a stop string and searches
it again with each token, on the gateway's event loop and the engine's step thread. Each case
streams a text that follows long stop strings (so long tails are held back) and then breaks
away; the worst token is the one where a long held-back tail stops matching. Each case runs
with the checker as it is and with its held-back search replaced by the plain definition (every
prefix length compared, longest first), in turns, `--rounds` times; the table keeps each
case's lowest mean and lowest worst token over the rounds (a spike of the machine's own lands
in one round, the search's in every round).

    python bench/stop_strings.py --out bench/results/stop_strings
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, keep_lowest, run_name, write_results  # noqa: E402

from cleave.generation.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams  # noqa: E402
from cleave.generation.stop import StopChecker  # noqa: E402

COLUMNS = ["case", "search", "stops", "stop_chars", "tokens", "mean_us", "worst_ms"]


class PlainSearchChecker(StopChecker):
    """The held-back search as its definition reads: every prefix length, longest first."""

    def _stop_prefix_length(self, buffer: str) -> int:
        longest = 0
        for stop in self._stop_strings:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest


@dataclass(frozen=True)
class Case:
    name: str
    stops: list[str]
    pieces: list[str]  # the stream's token texts, repeated


def cases() -> list[Case]:
    longest = MAX_STOP_STRING_CHARS
    many = MAX_STOP_STRINGS
    return [
        Case("output a*999 then b", ["a" * (longest - 1) + str(i % 10) for i in range(many)], ["a"] * 999 + ["b"]),
        Case("output abab.. then bb", ["ab" * (longest // 2 - 1) + str(i % 10) for i in range(many)],
             ["a", "b"] * 499 + ["b", "b"]),
        Case("output a*1000 then c, stops a*500 b a*", ["a" * 500 + "b" + "a" * (longest - 501)] * many,
             ["a"] * 1000 + ["c"]),
        Case("plain text, one short stop", ["</answer>"], ["The", " answer", " is", " 4", "."]),
        Case("plain text, four short stops", ["</answer>", "\n\nUser:", "<|im_end|>", "Observation:"],
             ["The", " answer", " is", " 4", " </", "ans", "."]),
    ]


def run_case(checker_type: type[StopChecker], case: Case, tokens: int) -> tuple[float, float]:
    """(mean us a token, worst ms a token) over `tokens` tokens of the case's stream."""
    checker = checker_type(SamplingParams(stop=case.stops, max_tokens=tokens + 1))
    worst, pieces = 0.0, case.pieces
    start = time.perf_counter()
    for index in range(tokens):
        before = time.perf_counter()
        checker.check_token(5)
        finished = checker.append_text(pieces[index % len(pieces)]).finished
        worst = max(worst, time.perf_counter() - before)
        if finished:
            raise RuntimeError(f"{case.name}: a stop string ended the stream")
    return (time.perf_counter() - start) / tokens * 1e6, worst * 1e3


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    best: dict[tuple[str, str], dict] = {}
    for _ in range(args.rounds):
        for case in cases():
            for search, checker_type in (("tail search", StopChecker), ("every length", PlainSearchChecker)):
                mean_us, worst_ms = run_case(checker_type, case, args.tokens)
                row = {"case": case.name, "search": search, "stops": len(case.stops),
                       "stop_chars": max(map(len, case.stops)), "tokens": args.tokens, "mean_us": round(mean_us, 2),
                       "worst_ms": round(worst_ms, 3)}
                keep_lowest(best, (case.name, search), row, ("mean_us", "worst_ms"))
    rows = list(best.values())
    print(format_table(rows, COLUMNS))
    if args.out:
        write_results(args.out, run_name("stop-strings"), rows, COLUMNS, summary={"rounds": args.rounds})
    return rows


if __name__ == "__main__":
    main()
