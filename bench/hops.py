"""Where a request's time goes: per-hop latencies from a directory of trace files.

The services write one JSON line per span (`cleave up --trace-dir DIR`, `StackSpec.trace_dir`,
`bench/disagg.py --trace`; see `cleave.tracing.file_exporter`). Spans are grouped by trace id
(one trace per request; lone spans of calls made outside a request, such as load polls, are
left out); a hop is a span name: the server span of each RPC
(`cleave.v1.Decode/Admit`, ...), `gateway.tokenize`, `engine.queue_wait`,
`engine.prefill_forward`, `gateway.first_byte`... Each hop's row has the p50/p99 of its
duration and the median of when it starts after the request arrived (`start_p50_ms`), and
rows are in that order, so the table reads like a request's timeline. Gaps between the hops
of one request follow (`GAPS`), e.g. gateway receive -> first byte, the time to first token
as the gateway sees it.

    python bench/hops.py /tmp/traces            # table
    python bench/hops.py /tmp/traces --json     # rows as JSON
    from hops import hop_table                  # rows for other bench scripts
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

HOP_COLUMNS = ["hop", "services", "count", "p50_ms", "p99_ms", "start_p50_ms"]
ROOT = "<request>"  # the trace's first span without a parent in it: the gateway's receipt
# (label, (span name, edge), (span name, edge)): per trace, the first span of each name
GAPS: tuple[tuple[str, tuple[str, str], tuple[str, str]], ...] = (
    ("gap: gateway receive -> first byte", (ROOT, "start"), ("gateway.first_byte", "start")),
    ("gap: gateway receive -> prefill receive", (ROOT, "start"), ("cleave.v1.Prefill/Prefill", "start")),
    ("gap: prefill forward end -> first byte", ("engine.prefill_forward", "end"), ("gateway.first_byte", "start")),
    ("gap: prefill forward end -> first tokens out", ("engine.prefill_forward", "end"),
     ("prefill.first_tokens", "start")),
    ("gap: first tokens out -> first byte", ("prefill.first_tokens", "end"), ("gateway.first_byte", "start")),
    ("gap: prefill end -> decode start", ("cleave.v1.Prefill/Prefill", "end"), ("cleave.v1.Decode/Start", "start")),
)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated q-th percentile (None for no values); the load scripts' own, kept
    here so reading traces imports no client code."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def read_spans(trace_dir: Path) -> list[dict]:
    """Every span in the directory's *.jsonl files (a line cut short by a killed process is
    skipped)."""
    spans = []
    for path in sorted(Path(trace_dir).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                spans.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return spans


def group_traces(spans: Iterable[dict]) -> dict[str, list[dict]]:
    """trace id -> its spans."""
    traces: dict[str, list[dict]] = defaultdict(list)
    for span in spans:
        traces[span["trace_id"]].append(span)
    return traces


def trace_root(spans: list[dict]) -> dict:
    """The earliest span whose parent is not in the trace (the request's first hop)."""
    ids = {span["span_id"] for span in spans}
    roots = [span for span in spans if span["parent_span_id"] not in ids] or spans
    return min(roots, key=lambda span: span["start_ns"])


def _edge_ns(spans: list[dict], root: dict, name: str, edge: str) -> int | None:
    if name == ROOT:
        chosen: dict | None = root
    else:
        chosen = min((span for span in spans if span["name"] == name), key=lambda span: span["start_ns"], default=None)
    return None if chosen is None else chosen[f"{edge}_ns"]


def hop_table(trace_dir: Path) -> list[dict]:
    """One row per hop (`HOP_COLUMNS`), in timeline order, then one per gap in `GAPS` that
    any trace has."""
    durations: dict[str, list[float]] = defaultdict(list)
    offsets: dict[str, list[float]] = defaultdict(list)
    services: dict[str, set[str]] = defaultdict(set)
    gaps: dict[str, list[float]] = defaultdict(list)
    for spans in group_traces(read_spans(trace_dir)).values():
        if len(spans) == 1:  # a call outside any request: load polls, the Attach stream
            continue
        root = trace_root(spans)
        for span in spans:
            durations[span["name"]].append((span["end_ns"] - span["start_ns"]) / 1e6)
            offsets[span["name"]].append((span["start_ns"] - root["start_ns"]) / 1e6)
            services[span["name"]].add(span["service"].removeprefix("cleave-"))
        for label, (start_name, start_edge), (end_name, end_edge) in GAPS:
            start, end = _edge_ns(spans, root, start_name, start_edge), _edge_ns(spans, root, end_name, end_edge)
            if start is not None and end is not None:
                gaps[label].append((end - start) / 1e6)
    rows = [
        {"hop": name, "services": ",".join(sorted(services[name])), "count": len(values),
         "p50_ms": percentile(values, 50), "p99_ms": percentile(values, 99),
         "start_p50_ms": percentile(offsets[name], 50)}
        for name, values in durations.items()
    ]
    rows.sort(key=lambda row: (row["start_p50_ms"], row["hop"]))
    rows += [
        {"hop": label, "services": "", "count": len(gaps[label]), "p50_ms": percentile(gaps[label], 50),
         "p99_ms": percentile(gaps[label], 99), "start_p50_ms": None}
        for label, _, _ in GAPS if gaps[label]
    ]
    return rows


def format_hop_table(rows: list[dict]) -> str:
    """The rows as a fixed-width table (`common.format_table`)."""
    from common import format_table  # imports torch: only when printing

    return format_table(rows, HOP_COLUMNS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace_dir", type=Path, help="directory of the services' *.jsonl trace files")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    rows = hop_table(args.trace_dir)
    if not rows:
        print(f"no spans in {args.trace_dir}/*.jsonl", file=sys.stderr)
        return 1
    print(json.dumps(rows, indent=1) if args.json else format_hop_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
