"""An HTTP request's JSON body, read within the gateway's `--max-request-bytes`.

A body whose Content-Length is over the limit is refused with 413 before it is read — for
`Expect: 100-continue` before the client sends it, so the client never uploads it; a
chunked body is cut off by aiohttp's `client_max_size` (the same limit) once it passes it.
A body that is not JSON (bad UTF-8, bad syntax, nesting deeper than the parser's recursion
limit), or that does not decode as its `Content-Encoding` says, is a 400 naming `body`; one
in a coding aiohttp does not know (it hands such bytes on undecoded) is a 415 naming
`Content-Encoding`; one that has not all arrived within the body timeout is a 408, and the
connection closes. A body over `INLINE_PARSE_MAX_BYTES` is parsed in a worker thread; but
CPython's json parser holds the interpreter's lock from start to end, so the event loop waits
for it all the same (0.3 s for a 33 MB body of a million chat turns, the loop's longest pause
while the request was refused). The thread frees the loop only on an interpreter without that
lock; bounding the pause further takes a smaller `--max-request-bytes`.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from aiohttp import HttpVersion11, web
from aiohttp.web_protocol import RequestPayloadError
from aiohttp.web_urldispatcher import _default_expect_handler  # "100 Continue", as aiohttp answers it

from cleave.errors import InvalidArgument
from services.gateway.openai_request import BodyEncodingUnsupported, BodyTimedOut, BodyTooLarge, http_error

_EXPECTATION_FAILED = 417
DEFAULT_BODY_TIMEOUT_S = 60.0  # a body must arrive whole within this (else 408)
INLINE_PARSE_MAX_BYTES = 1 << 20  # a larger body is parsed in a worker thread, off the event loop
# no coding, or one aiohttp's parser decodes (br and zstd without their packages fail in the
# parser itself: `http_errors`)
_READABLE_CODINGS = frozenset({"", "identity", "gzip", "deflate", "br", "zstd"})


def _content_coding(request: web.Request) -> str:
    """The request's Content-Encoding as aiohttp's parser compares it (case-folded if ASCII)."""
    coding = request.headers.get("Content-Encoding", "")
    return coding.lower() if coding.isascii() else coding


def body_too_large(max_bytes: int, num_bytes: int | None) -> BodyTooLarge:
    """The 413 of a body of `num_bytes` (None: one cut off past `max_bytes`, its size unknown)."""
    size = f"is {num_bytes} bytes" if num_bytes is not None else f"is over {max_bytes} bytes"
    return BodyTooLarge(
        f"the request body {size}; this gateway accepts at most {max_bytes} bytes (--max-request-bytes)",
        field="body",
    )


def expect_handler(max_bytes: int):  # type: ignore[no-untyped-def]
    """An aiohttp `expect_handler` that answers 413 instead of "100 Continue" when the
    announced body is over `max_bytes`, and 417 to an expectation other than 100-continue
    (aiohttp's own 417 echoes the header, and fails with a 500 when it is not UTF-8)."""

    async def check(request: web.Request) -> web.StreamResponse | None:
        if request.content_length is not None and request.content_length > max_bytes:
            mapped = http_error(body_too_large(max_bytes, request.content_length), {})
            response = web.json_response(mapped.body, status=mapped.status)
            response.force_close()  # the body was never sent: the connection can't carry another request
            return response
        if request.version == HttpVersion11 and request.headers.get("Expect", "").lower() != "100-continue":
            mapped = http_error(InvalidArgument("only 100-continue is supported", field="Expect"), {})
            response = web.json_response(mapped.body, status=_EXPECTATION_FAILED)
            response.force_close()
            return response
        return await _default_expect_handler(request)

    return check


async def read_json(request: web.Request, max_bytes: int, timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> Any:
    """The parsed body; raises BodyTooLarge over `max_bytes`, BodyTimedOut when it has not
    all arrived within `timeout_s`, InvalidArgument (field `body`) when it is not JSON."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise body_too_large(max_bytes, request.content_length)
    if _content_coding(request) not in _READABLE_CODINGS:
        raise BodyEncodingUnsupported()  # aiohttp hands an unknown coding's bytes on as they came
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise BodyTimedOut(f"did not arrive whole within {timeout_s:g} s", field="body") from None
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(max_bytes, None) from None
    except RequestPayloadError as error:  # a Content-Encoding (gzip, deflate) that does not decode
        encoding = request.headers.get("Content-Encoding", "")
        raise InvalidArgument(f"does not decode as its Content-Encoding {encoding!r}", field="body") from None
    try:
        if len(raw) > INLINE_PARSE_MAX_BYTES:
            # 30 MB takes 0.3 s to parse, holding the interpreter's lock (the module docstring)
            return await asyncio.to_thread(json.loads, raw)
        return json.loads(raw)
    except RecursionError:
        raise InvalidArgument("is nested too deeply to parse", field="body") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InvalidArgument(f"is not valid JSON ({error})", field="body") from None
    except ValueError:  # int() refuses a number this long (its message tells a programmer what to change)
        raise InvalidArgument(f"holds an integer of more than {sys.get_int_max_str_digits()} digits",
                              field="body") from None
