"""Routing errors of the HTTP API in OpenAI's error shape.

aiohttp answers an unknown path or a wrong method in plain text; OpenAI clients parse
`{"error": {"message", "type", "param", "code"}}` from every non-2xx answer, so this
middleware rewrites those answers (404 `not_found_error`, 405 `invalid_request_error`).
"""

from __future__ import annotations

from aiohttp import web


@web.middleware
async def json_routing_errors(request: web.Request, handler) -> web.StreamResponse:  # type: ignore[no-untyped-def]
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return _error(404, "not_found_error", f"no route {request.method} {request.path}; "
                      "see GET /v1/models, POST /v1/completions, POST /v1/chat/completions")
    except web.HTTPMethodNotAllowed as error:
        allowed = ", ".join(sorted(error.allowed_methods))
        return _error(405, "invalid_request_error", f"{request.method} is not allowed on {request.path} "
                      f"(allowed: {allowed})", headers={"Allow": allowed})


def _error(status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": error_type, "param": None, "code": None}}
    return web.json_response(body, status=status, headers=headers)
