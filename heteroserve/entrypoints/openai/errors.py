"""OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "TimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "InternalServerError",  # a back end failed the gateway; OpenAI's client raises InternalServerError for it
    503: "ServiceUnavailableError",
}
# What a 429's Retry-After asks for: a waiting place frees as soon as the engine schedules a request (steps take
# milliseconds), so a second later is a fair first retry; clients back off further on their own.
RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        # protocol.ErrorResponse documents this shape in the OpenAPI schema (protocol imports this module).
        kind = _TYPES.get(self.status, "Error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status == 429 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)
