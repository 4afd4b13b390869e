"""Errors as the routes render them, and the request-size limit.

A client error names the offending field (`param`). On /v1 routes it has OpenAI's shape {"error": {"message",
"type", "param", "code"}} (validation errors as 400 invalid_request_error, like OpenAI); on the others FastAPI's
{"detail": [{loc, msg}]}. A client gone before its reply gets 499, anything unexpected a 500 that says no more.
BodyLimit refuses a body over MAX_REQUEST_BYTES with 413 before anything parses it."""

from __future__ import annotations

import logging
from typing import Any, Optional

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

MAX_REQUEST_BYTES = 1 << 20  # 1 MiB: far above any prompt that fits a model context, far below harm
log = logging.getLogger(__name__)


class ApiError(Exception):
    """A client error naming the offending field (`param`), rendered per route (plain or OpenAI shape)."""

    def __init__(self, param: str, message: str, status: int = 422, code: Optional[str] = None):
        super().__init__(message)
        self.param, self.message, self.status, self.code = param, message, status, code


class ClientGone(Exception):
    """The client of a plain request disconnected before its completion was ready."""


def _clean(text: Any, limit: int = 200) -> str:
    """A string safe to put in a JSON error: valid UTF-8 (surrogates escaped), bounded length."""
    text = str(text)
    text = text if len(text) <= limit else text[:limit] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _is_openai(request: Request) -> bool:
    return request.url.path.startswith("/v1/")


def error_response(
    request: Request, status: int, errors: list[dict], code: Optional[str] = None, headers: Optional[dict] = None
) -> JSONResponse:
    """errors: [{"param": "messages.0.role", "message": "..."}]. /v1 routes: OpenAI's error object (validation
    errors as 400 invalid_request_error, like OpenAI); other routes: FastAPI's {"detail": [{loc, msg}]}."""
    if _is_openai(request):
        first = errors[0] if errors else {"param": None, "message": "error"}
        message = "; ".join(f"{e['param']}: {e['message']}" if e["param"] else e["message"] for e in errors)
        kind = "server_error" if status >= 500 else "invalid_request_error"
        status = 400 if status == 422 else status
        body = {
            "error": {
                "message": _clean(message, 2000),
                "type": kind,
                "param": _clean(first["param"]) if first["param"] else None,
                "code": code,
            }
        }
    else:
        body = {
            "detail": [
                {
                    "loc": ["body", *(_clean(first) for first in str(e["param"]).split("."))] if e["param"] else [],
                    "msg": _clean(e["message"], 2000),
                }
                for e in errors
            ]
        }
    return JSONResponse(body, status_code=status, headers=headers)


def _field_path(loc) -> Optional[str]:
    """'messages.0.role' from pydantic's loc, without the body prefix and the union-member tags it inserts
    ('str', 'list[TextPart]', 'function-after[...]')."""
    parts = [
        str(x)
        for x in loc
        if isinstance(x, int) or (x != "body" and x.isidentifier() and x not in ("str", "int", "float", "bool", "list"))
    ]
    return ".".join(_clean(x, 60) for x in parts) or None


def _describe(err: dict) -> dict:
    param = _field_path(err.get("loc", ()))
    if err["type"] == "extra_forbidden":
        msg = "not supported by this server (unknown or unsupported field)"
    elif err["type"] in ("json_invalid", "json_type"):
        msg = "request body is not valid JSON"
    elif err["type"] == "finite_number":
        msg = "must be a finite number (NaN and Infinity are not numbers)"
    elif err["type"] == "value_error" and "error" in (err.get("ctx") or {}):
        msg = str(err["ctx"]["error"])  # our validators' own message, without pydantic's "Value error, "
    else:
        msg = err.get("msg", "invalid value")
    return {"param": param, "message": msg}


def _dedupe(errors: list[dict]) -> list[dict]:
    """A union (content, stop) reports one error per alternative: keep the first per field."""
    seen, out = set(), []
    for error in errors:
        if error["param"] not in seen:
            seen.add(error["param"])
            out.append(error)
    return out[:10]


# ------------------------------------------------------------------------------- handlers
async def _validation_error(request: Request, exc: RequestValidationError):
    return error_response(request, 422, _dedupe([_describe(e) for e in exc.errors()]))


async def _api_error(request: Request, exc: ApiError):
    return error_response(request, exc.status, [{"param": exc.param, "message": exc.message}], code=exc.code)


async def _http_error(request: Request, exc: StarletteHTTPException):
    return error_response(
        request,
        exc.status_code,
        [{"param": None, "message": _clean(exc.detail)}],
        headers=getattr(exc, "headers", None),
    )


async def _client_gone(request: Request, exc: ClientGone):
    return Response(status_code=499)  # nobody reads it: the client disconnected (nginx's 499)


async def _internal_error(request: Request, exc: Exception):
    log.exception("unhandled error")
    return error_response(request, 500, [{"param": None, "message": "internal server error"}])


HANDLERS = {  # FastAPI(exception_handlers=...)
    RequestValidationError: _validation_error,
    ApiError: _api_error,
    StarletteHTTPException: _http_error,
    ClientGone: _client_gone,
    Exception: _internal_error,
}


# ----------------------------------------------------------------------------- size limit
class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` (declared or streamed) gets 413 before any parsing."""

    def __init__(self, app, max_bytes: int = MAX_REQUEST_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._too_large(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
            chunks.append(chunk)
            more = msg.get("more_body", False)
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        request = Request(scope)
        resp = error_response(
            request,
            413,
            [{"param": None, "message": f"request body larger than {self.max_bytes} bytes"}],
            code="request_too_large",
            headers={"connection": "close"},
        )
        await resp(scope, receive, send)
