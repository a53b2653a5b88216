"""The Anthropic API's error body: ``{"type": "error", "error": {"type", "message"}}``."""

from __future__ import annotations

from router.gateway.anthropic.protocol import AnthropicError, AnthropicErrorDetail

KINDS: dict[int, str] = {}  # the shared error types (router/gateway/errors.py) are Anthropic's own


def render(status: int, message: str, kind: str) -> AnthropicError:
    return AnthropicError(error=AnthropicErrorDetail(type=kind, message=message))
