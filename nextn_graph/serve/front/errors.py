"""Errors a request gets back, in OpenAI's shape: ``{"error": {"message", "type",
"param", "code"}}`` with an HTTP status. Every refusal goes through ``APIError``, so a
client never sees a traceback or an HTML page; ``error_body`` is the one renderer, and
what it renders can always be encoded (a field name or message may hold anything a JSON
body does, a lone surrogate included)."""

from __future__ import annotations

from dataclasses import dataclass, field

# OpenAI's error types by status (what its clients map to exception classes); any other
# 4xx is an invalid_request_error, any other 5xx a server_error
TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
         503: "service_unavailable"}


def error_type(status: int) -> str:
    return TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


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
        return error_body(self.message, error_type(self.status), self.param, self.code)


def bad_value(message: str, param: str | None) -> APIError:
    """A 400 for a field's value (``param``: the field; None: the body as a whole)."""
    return APIError(400, message, param=param, code="invalid_value")


def encodable(text: str | None) -> str | None:
    """``text`` as UTF-8 can hold it: a lone surrogate (which JSON's ``\\ud800`` escape
    can carry into a field name or value) becomes the six characters ``\\ud800``."""
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, kind: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": encodable(message), "type": kind, "param": encodable(param),
                      "code": code}}
