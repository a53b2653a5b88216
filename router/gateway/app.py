"""The HTTP gateway's ASGI app: every tenant's OpenAI-, Anthropic- and Gemini-compatible APIs, cached content
objects and Prometheus metrics, under ``/{tenant}/...``, the admin API under ``/admin``, and the probes
``/health`` and ``/ready`` at the root. ``create_app`` binds the routes of each API to one replica's ``Gateway``;
router/gateway/server.py serves the app from every gateway replica.

    router/gateway/core.py                    the Gateway: its parts built and wired; docs, a tenant's metrics
    router/gateway/admission.py               the tenant's key, the body, limits, in-flight places, the context
    router/gateway/prompts.py                 chat templates and tokenizing off the event loop; parameters
    router/gateway/generation.py              one request routed (router_pool.py, hedged), streamed, retried
    router/gateway/accounting.py              usage and cost; background writes
    router/gateway/errors.py                  ApiError, rendered by each API's own errors.py
    router/gateway/wire.py                    what the APIs' request and response models share
    router/gateway/openai/                    /v1/models, /v1/chat/completions, /v1/completions
    router/gateway/anthropic/                 /v1/messages (cache_control breakpoints), /v1/messages/count_tokens
    router/gateway/gemini/                    the Gemini API (/v1beta) and the tenant's /v1/cachedContents
    router/gateway/usage_api.py               /v1/usage, /v1/cache/advice; the admin API's usage, alerts, metrics
    router/gateway/health.py                  /health (liveness) and /ready (readiness: Redis, a router, a group)
    router/gateway/access.py                  X-Request-Id on every response, one access log line per request

One app serves every tenant, so no route lists them, and an unknown tenant gets exactly the 401 of a wrong
key."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import Response

from router.gateway import core, tenant_admin, usage_api
from router.gateway.access import AccessLog
from router.gateway.anthropic import serving as anthropic
from router.gateway.core import Gateway
from router.gateway.errors import ApiError, api_error, store_unavailable
from router.gateway.gemini import cached_contents, serving as gemini
from router.gateway.health import Health
from router.gateway.openai import chat as openai_chat, completions as openai_completions, serving as openai
from router.gateway.store import StoreUnavailable
from router.gateway.tracing import TraceMiddleware

__all__ = ["Gateway", "create_app"]


async def _healthz() -> Response:
    """For a load balancer in front of the frontend nodes: this replica serves (no tenant data)."""
    return Response("success", media_type="text/plain")


def create_app(gateway: Gateway, admin: FastAPI | None = None, health: Health | None = None) -> FastAPI:
    """The gateway's ASGI app: every tenant's routes bound to ``gateway``, the admin API under ``/admin``, the
    probes ``/health`` and ``/ready`` (``health``: the replica's, which the admin API shares; else one of its own),
    and around it all the request ids and the access log (router/gateway/access.py)."""
    app = FastAPI(title="kvgrid gateway", docs_url=None, redoc_url=None, openapi_url=None)
    # Starlette types a handler as taking any Exception; each is called only with the class it is added for.
    app.add_exception_handler(ApiError, api_error)  # type: ignore[arg-type]
    app.add_exception_handler(StoreUnavailable, store_unavailable)  # type: ignore[arg-type]
    app.add_middleware(AccessLog, enabled=gateway.config.logging.access_log)
    app.add_api_route("/-/healthz", _healthz, methods=["GET"], include_in_schema=False)
    health = health if health is not None else Health(gateway.redis, gateway.pool.routers)
    app.add_api_route("/health", health.health, methods=["GET"], include_in_schema=False)
    app.add_api_route("/ready", health.ready, methods=["GET"], include_in_schema=False)
    if admin is not None:
        app.mount("/admin", admin)  # before the tenant routes: "/{tenant}/..." would take "/admin/..." too
    core.routes.include(app, gateway)
    openai.routes.include(app, openai.OpenAIServing(gateway))
    openai_chat.routes.include(app, openai_chat.ChatCompletions(gateway))
    openai_completions.routes.include(app, openai_completions.Completions(gateway))
    anthropic.routes.include(app, anthropic.AnthropicApi(gateway))
    cached_contents.routes.include(app, cached_contents.CachedContentsApi(gateway))
    usage = usage_api.UsageApi(gateway)
    usage_api.routes.include(app, usage)
    if admin is not None:
        usage_api.mount_admin(admin, usage)
        tenant_admin.mount_admin(admin, gateway)  # tenants and keys at run time, the audit log
    gemini.routes.include(app, gemini.GeminiApi(gateway))
    if gateway.tracing is not None:  # each request's root span (router/gateway/tracing.py); added last: outermost
        app.add_middleware(TraceMiddleware, tracing=gateway.tracing)
    return app
