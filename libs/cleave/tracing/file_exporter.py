"""`JsonLinesSpanExporter`: finished spans as JSON lines in a file, for `bench/hops.py`.

One object per span:

    {"name": "engine.queue_wait", "service": "cleave-prefill", "kind": "INTERNAL",
     "trace_id": "<32 hex>", "span_id": "<16 hex>", "parent_span_id": "<16 hex>" | null,
     "start_ns": 1718000000000000000, "end_ns": ..., "status": "UNSET" | "OK" | "ERROR",
     "attributes": {"request_id": "..."}}

Runs on the BatchSpanProcessor's thread, never on a request's path.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import format_span_id, format_trace_id


def span_record(span: ReadableSpan, service: str) -> dict[str, Any]:
    """The JSON object of one finished span."""
    context = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "service": service,
        "kind": span.kind.name,
        "trace_id": format_trace_id(context.trace_id),
        "span_id": format_span_id(context.span_id),
        "parent_span_id": format_span_id(parent.span_id) if parent is not None else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": {key: list(value) if isinstance(value, tuple) else value
                       for key, value in (span.attributes or {}).items()},
    }


class JsonLinesSpanExporter(SpanExporter):
    """Appends each exported span to `path` as one JSON line (the directory is created).

    Args:
        path: the file; several processes must not share one.
        service: written as each span's "service" (the resource's service.name).
    """

    def __init__(self, path: Path, service: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.service = service
        self._file = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()  # export and shutdown may come from different threads

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(span, self.service)) + "\n" for span in spans)
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every export is flushed already

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()
