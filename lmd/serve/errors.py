"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}} with the matching HTTP status."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

if TYPE_CHECKING:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param)


def install_error_handlers(app: FastAPI, on_error: Callable[[str, int], None]) -> None:
    """Every error leaves in OpenAI's shape; `on_error(path, status)` is told of each (for /metrics)."""
    from fastapi.exceptions import RequestValidationError

    def answer(request: Request, error: ApiError) -> JSONResponse:
        on_error(request.url.path, error.status)
        return error.response()

    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return answer(request, exc)

    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(request, validation_error(exc))

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return answer(request, ApiError(exc.status_code, str(exc.detail)))

    app.add_exception_handler(ApiError, on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http_error)  # type: ignore[arg-type]


def validation_error(exc: RequestValidationError) -> ApiError:
    """The first pydantic error as a 400 naming the field, e.g. "messages.0.role: Field required"."""
    errors = exc.errors()
    if not errors:
        return bad_request(None, "the request body is invalid")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return bad_request(None, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip())
    if not loc:
        return bad_request(None, f"the request body is invalid: {first.get('msg')}; send a JSON object")
    # Union types report one error per member (e.g. "stop.str", "stop.list[str]"); name the field itself.
    field = ".".join(part for part in loc if not _is_union_tag(part))
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    got = repr(first.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return bad_request(field, f"{field}: {first.get('msg')}, got {got}{more}")


def _is_union_tag(part: str) -> bool:
    return any(ch in part for ch in "[]") or part in ("str", "int", "float", "bool", "list", "dict")
