"""The gateway's errors, each answered in the calling API's own format: ``ApiError`` carries the status, the
message, the error type and the API (``"openai"``, ``"anthropic"`` or ``"gemini"``), and each API's folder renders
its body (router/gateway/{openai,anthropic,gemini}/errors.py). ``group_failure`` says what a failed output of a
worker group means for the request."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from common.errors import GroupUnhealthyError, RequestAborted, RequestFailed
from router.gateway.anthropic import errors as anthropic_errors
from router.gateway.gemini import errors as gemini_errors
from router.gateway.openai import errors as openai_errors
from router.gateway.store import StoreUnavailable

STORE_RETRY_AFTER_S = 2.0
# What the error of a request the engine failed on its grammar says (worker/structured.py GrammarError): a 400,
# worded here, not the grammar engine's internals.
GRAMMAR_FAILED = "GrammarError: "

_APIS: dict[str, ModuleType] = {"openai": openai_errors, "anthropic": anthropic_errors, "gemini": gemini_errors}
_RENDER: dict[str, Callable[[int, str, str], BaseModel]] = {api: m.render for api, m in _APIS.items()}

# The error type of each status (Anthropic's names, which OpenAI shares but for 401: each API's KINDS overrides).
_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class GroupFailed(Exception):
    """The worker group running a request failed (died, lost a rank, or went silent): retried elsewhere."""


class ApiError(Exception):
    """An error answered in the calling API's own format (``api``: "openai", "anthropic" or "gemini")."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        api: str = "openai",
        retry_after: float = 1.0,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.api = status, message, kind, api
        self.retry_after = retry_after

    def body(self) -> BaseModel:
        return _RENDER[self.api](self.status, self.message, self.kind)

    def response(self) -> Response:
        headers = {"Retry-After": str(max(1, math.ceil(self.retry_after)))} if self.status in (429, 503) else None
        return Response(
            self.body().model_dump_json(), status_code=self.status, headers=headers, media_type="application/json"
        )


def err(status: int, message: str, api: str, retry_after: float = 1.0) -> ApiError:
    """The error of ``status`` in ``api``'s wording (its error type for the status)."""
    kind = _APIS[api].KINDS.get(status) or _KINDS.get(status, "api_error")
    return ApiError(status, message, kind, api, retry_after)


async def api_error(_: Request, exc: ApiError) -> Response:
    return exc.response()


async def store_unavailable(request: Request, exc: StoreUnavailable) -> Response:
    """Redis is down or slow: what needs it answers a retryable 503 at once instead of waiting (in the format
    of the API that admission (router/gateway/admission.py ``auth``) admitted the request to)."""
    api = getattr(request.state, "api", "openai")
    return err(503, "the service's state store is unavailable; retry shortly", api, STORE_RETRY_AFTER_S).response()


def group_failure(exc: Exception, group: str, api: str) -> Exception:
    """What a failed output of a group means: a bad request (400), an abort (503), the group itself failing (a
    retry elsewhere), or an error of this one request (500; the group keeps serving everyone else)."""
    if isinstance(exc, ValueError):
        return err(400, str(exc), api)
    if isinstance(exc, RequestAborted):
        return err(503, "the request was aborted on its worker group; retry it", api)
    if isinstance(exc, RequestFailed) and GRAMMAR_FAILED in str(exc):  # a grammar the gateway's checks let by
        return err(
            400,
            "the structured output (response_format or a forced tool call) is too complex for the grammar engine; "
            "simplify its schema",
            api,
        )
    if isinstance(exc, RequestFailed):  # the engine failed this request alone; its group keeps serving
        return ApiError(
            500,
            f"the request failed on worker group {group} ({exc}); the service keeps serving, "
            "retry it or change its parameters",
            "api_error",
            api,
        )
    if isinstance(exc, GroupUnhealthyError):
        return GroupFailed(f"{type(exc).__name__}: {exc}")
    return ApiError(500, f"internal error in worker group {group} ({type(exc).__name__})", "api_error", api)
