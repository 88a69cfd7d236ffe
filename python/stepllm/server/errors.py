"""OpenAI-style errors: one exception type carrying the HTTP status, and the JSON body every error answers with.

Body: {"error": {"message", "type", "param", "code"}}, as the official client parses it.
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import ValidationError
from starlette.responses import JSONResponse


class APIError(Exception):
    """An error answered to the client as an OpenAI error body with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized() -> APIError:
    return APIError(
        401,
        "Incorrect API key provided; send it as 'Authorization: Bearer <key>'.",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def overloaded(retry_after_s: int, waiting: int) -> APIError:
    return APIError(
        429,
        f"The server is at capacity ({waiting} requests waiting); retry after {retry_after_s} s.",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after_s)},
    )


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="engine_error")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _field_path(loc: tuple[int | str, ...]) -> tuple[str | None, bool]:
    """The dotted field path of a pydantic error location, without the union-member tags pydantic adds
    ('str', 'list[int]', ...); and whether any were dropped (the value matched none of a union's types)."""
    parts, dropped = [], False
    for p in loc:
        if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS):
            parts.append(str(p))
        else:
            dropped = True
    return (".".join(parts) or None), dropped


def from_validation(e: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the offending field."""
    errors = e.errors(include_url=False)
    if not errors:
        return bad_request(str(e))
    first = errors[0]
    param, union = _field_path(tuple(first.get("loc", ())))
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    msg = str(first.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    if param is None:
        return bad_request(msg, code="invalid_value")
    if union:
        return bad_request(f"Invalid type for '{param}': the value matches none of its accepted types ({msg})", param=param, code="invalid_type")
    return bad_request(f"Invalid value for '{param}': {msg}", param=param, code="invalid_value")
