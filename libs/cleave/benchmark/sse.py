"""Server-sent events: network bytes -> the `data` payload of each event.

A streamed OpenAI response is `data: {...}\\n\\n` events, but the network cuts the byte
stream anywhere: inside a line, between `\\r` and `\\n`, inside a multi-byte UTF-8
character. `SSEParser` buffers bytes until a line is complete, decodes whole lines only, and
hands out an event when its blank line arrives (WHATWG's event-stream rules: `:` lines are
comments, several `data` lines of one event join with newlines, `event`/`id`/`retry` fields
are ignored since OpenAI streams carry everything in `data`).
"""

from __future__ import annotations


class SSEParser:
    """Incremental parser: `feed(bytes)` returns the payloads of the events it completed."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data_lines: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            newline = self._buffer.find(b"\n")
            if newline < 0:
                break
            raw_line, self._buffer = self._buffer[:newline], self._buffer[newline + 1:]
            if raw_line.endswith(b"\r"):
                raw_line = raw_line[:-1]
            event = self._line(raw_line.decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[str]:
        """The events still pending at the end of the stream (a last line without its
        newline, an event without its blank line: servers that end abruptly)."""
        events = []
        if self._buffer:
            line, self._buffer = self._buffer.rstrip(b"\r").decode("utf-8", errors="replace"), b""
            event = self._line(line)
            if event is not None:
                events.append(event)
        event = self._line("")
        if event is not None:
            events.append(event)
        return events

    def _line(self, line: str) -> str | None:
        if not line:  # blank line: dispatch
            if not self._data_lines:
                return None
            event, self._data_lines = "\n".join(self._data_lines), []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data_lines.append(value[1:] if value.startswith(" ") else value)
        return None
