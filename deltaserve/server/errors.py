"""The server's error: one exception, written in the error shape of the API the request came in on.

Handlers raise ApiError(status, message, type, param, code) whatever the route; the app writes it as
OpenAI's {"error": {"message", "type", "param", "code"}} (the OpenAI routes, /v1/responses) or as
Anthropic's {"type": "error", "error": {"type", "message"}} (/v1/messages), so a client's SDK turns it
into its own exception class. Anthropic's shape has no `param`: the field is named in the message.
"""
from __future__ import annotations

ANTHROPIC_PREFIX = "/v1/messages"

# OpenAI error types -> Anthropic's (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "NotFoundError": "not_found_error",
    "not_found_error": "not_found_error",
    "service_unavailable": "overloaded_error",
    "internal_error": "api_error",
}
# error codes Anthropic gives a type of their own (a 413 is its request_too_large)
_ANTHROPIC_CODES = {"request_too_large": "request_too_large"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def anthropic_error_body(message: str, type_: str, param: str | None = None) -> dict:
    """Anthropic's error object; the field goes into the message when the message does not name it yet."""
    if param and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(type_, "invalid_request_error"),
                                       "message": message}}


def shaped_error_body(path: str, message: str, type_: str, param: str | None = None,
                      code: str | None = None) -> dict:
    """The error body in the shape of the API that owns `path`."""
    if path.startswith(ANTHROPIC_PREFIX):
        body = anthropic_error_body(message, type_, param)
        if code in _ANTHROPIC_CODES:
            body["error"]["type"] = _ANTHROPIC_CODES[code]
        return body
    return error_body(message, type_, param, code)


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)
