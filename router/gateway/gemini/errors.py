"""The Gemini API's error body: ``{"error": {"code", "message", "status"}}``, the status named as google.rpc.Code
names it."""

from __future__ import annotations

from router.gateway.gemini.protocol import GeminiError, GeminiErrorDetail

KINDS: dict[int, str] = {}  # Gemini names no error type: its status name stands for it

# google.rpc.Code names of the HTTP statuses the gateway answers.
_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    503: "UNAVAILABLE",
}


def render(status: int, message: str, kind: str) -> GeminiError:
    name = _STATUS.get(status, "INTERNAL" if status >= 500 else "FAILED_PRECONDITION")
    return GeminiError(error=GeminiErrorDetail(code=status, message=message, status=name))
