"""Errors as values at the edge: one exception type, rendered in the shape
of the API the client called (OpenAI or Anthropic)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
ANTHROPIC_STATUSES = {503: 529}  # Anthropic has no 503: "overloaded" is its 529


class APIError(Exception):
    """A request that ends with ``status``; ``param`` names the field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        anthropic_message: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.anthropic_message = anthropic_message  # the Messages API's own wording, where its clients read it

    def openai(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": OPENAI_TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    @property
    def anthropic_status(self) -> int:
        return ANTHROPIC_STATUSES.get(self.status, self.status)

    def anthropic(self) -> dict[str, Any]:
        return {
            "type": "error",
            "error": {
                "type": ANTHROPIC_TYPES.get(self.status, "api_error"),
                "message": self.anthropic_message or self.message,
            },
        }


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def from_validation_error(exc: ValidationError) -> APIError:
    """The first validation problem, naming its field (e.g. ``messages.0.role``)."""
    err = exc.errors(include_url=False)[0]
    # drop pydantic's union-member and validator tags (``str``, ``list[int]``, ``function-after[...]``)
    loc = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p)))
    reason = err["msg"].removeprefix("Value error, ")
    message = f"Invalid value for '{loc}': {reason}" if loc else reason
    return APIError(400, message, param=loc or None, code="invalid_value")
