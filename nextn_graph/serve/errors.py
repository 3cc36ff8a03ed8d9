"""Errors a request gets back, in OpenAI's shape: ``{"error": {"message", "type",
"param", "code"}}`` with an HTTP status. Every refusal goes through ``APIError``, so a
client never sees a traceback or an HTML page."""

from __future__ import annotations

from dataclasses import dataclass, field

# OpenAI's error types by status (what its clients map to exception classes)
TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
         503: "service_unavailable"}


# The engine's names of request fields (``InputError.field``) that the API spells
# otherwise; every other field has the same name in both.
_API_NAMES = {"max_new_tokens": "max_tokens", "stop_ids": "stop_token_ids"}


def api_param(field: str | None) -> str | None:
    """The API parameter of an engine refusal's field (None: no single field)."""
    return _API_NAMES.get(field, field) if field else None


@dataclass
class APIError(Exception):
    status: int
    message: str
    param: str | None = None  # the request field at fault, when one is
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)  # e.g. Retry-After on a 429

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict:
        return error_body(self.message, TYPES.get(self.status, "server_error"), self.param,
                          self.code)


def error_body(message: str, kind: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
