"""Tool-call parsing of one long call as it streams (CPU, one thread): the gateway's cost of a
call the model writes over tens of thousands of tokens.

The Hermes and harmony parsers (`cleave.generation.tool_calls`) hold a call's text until its
end marker arrives. Each case streams one call's opening, then `--pieces` pieces of
`--piece-chars` characters inside it, then its end, through the parser as it is and through
one that searches the whole held call again with each piece (its search offset reset before
every piece), in turns, `--rounds` times; the table keeps each one's fastest time.

    python bench/tool_call_stream.py --out bench/results/tool_calls
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import format_table, keep_lowest, run_name, write_results  # noqa: E402

from cleave.generation.tool_calls import HarmonyToolParser, HermesToolParser, ToolParse  # noqa: E402

COLUMNS = ["format", "search", "pieces", "piece_chars", "total_ms", "us_per_piece", "calls"]
# each format's call opening and end around the streamed arguments
FORMATS = {
    "hermes": (HermesToolParser, '<tool_call>{"name": "f", "arguments": {"x": "', '"}}</tool_call>'),
    "harmony": (HarmonyToolParser, '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"x": "',
                '"}<|call|>'),
}


def rescanning(parser_type: type) -> type:
    """`parser_type` searching the whole held call again with each piece."""

    class Rescanning(parser_type):  # type: ignore[valid-type, misc]
        def feed(self, text: str) -> ToolParse:
            self._searched = 0
            return super().feed(text)

    return Rescanning


def stream(parser_type: type, opening: str, end: str, pieces: int, piece: str) -> tuple[float, int]:
    """(seconds of the pieces inside the call, calls parsed)."""
    parser = parser_type()
    parser.feed(opening)
    start = time.perf_counter()
    for _ in range(pieces):
        parser.feed(piece)
    seconds = time.perf_counter() - start
    calls = len(parser.feed(end).tool_calls) + len(parser.finish().tool_calls)
    return seconds, calls


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pieces", type=int, default=30000)
    parser.add_argument("--piece-chars", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    piece = "abcd" * (args.piece_chars // 4) + "abcd"[: args.piece_chars % 4]
    best: dict[tuple[str, str], dict] = {}
    for _ in range(args.rounds):
        for name, (parser_type, opening, end) in FORMATS.items():
            for search, kind in (("from where it stopped", parser_type), ("whole call", rescanning(parser_type))):
                seconds, calls = stream(kind, opening, end, args.pieces, piece)
                row = {"format": name, "search": search, "pieces": args.pieces, "piece_chars": args.piece_chars,
                       "total_ms": round(seconds * 1e3, 1), "us_per_piece": round(seconds / args.pieces * 1e6, 2),
                       "calls": calls}
                keep_lowest(best, (name, search), row, ("total_ms", "us_per_piece"))
    rows = list(best.values())
    print(format_table(rows, COLUMNS))
    if args.out:
        write_results(args.out, run_name("tool-call-stream"), rows, COLUMNS, summary={"rounds": args.rounds})
    return rows


if __name__ == "__main__":
    main()
