"""The OpenAI API's error body: ``{"error": {"message", "type", "code"}}``, and the error type it gives a status."""

from __future__ import annotations

from router.gateway.openai.protocol import OpenAIError, OpenAIErrorDetail

# OpenAI answers a wrong key as an invalid request, not an authentication error.
KINDS = {401: "invalid_request_error"}


def render(status: int, message: str, kind: str) -> OpenAIError:
    return OpenAIError(error=OpenAIErrorDetail(message=message, type=kind, code=status))
