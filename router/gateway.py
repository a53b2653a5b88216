"""One tenant's HTTP gateway (a Ray Serve deployment): OpenAI- and Anthropic-compatible APIs, cached content
objects, Prometheus metrics. It authenticates, tokenises, applies the tenant's cache policy, asks the router
for a worker group, streams the group's outputs back, and records usage in Redis."""

# No "from __future__ import annotations" here: FastAPI must see real types on the route methods.


import json
import math
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import redis
import xxhash
from fastapi import FastAPI, Request
from jinja2 import TemplateError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.exceptions import RayActorError, RayError

from common.config import ServeConfig, TenantConfig, parse_duration
from common.hashing import token_bytes
from common.model_config import ModelConfig, load_tokenizer
from common.outputs import RequestOutput
from common.sampling import SamplingParams
from router.apis import (
    AnthropicMessage,
    CachedContentPatch,
    CachedContentRequest,
    ChatRequest,
    CompletionRequest,
    ContentBlock,
    MessagesRequest,
    gemini_text,
)
from router.router import NoGroup, Overloaded
from router.store import CachedContentStore, RateLimiter, TenantStore, UsageLedger

MAX_BODY_BYTES = 4 * 2**20
MAX_BREAKPOINTS = 4
MAX_PIN_TTL_S = 3600.0  # cache_control TTLs: Anthropic's longest
MAX_CACHED_CONTENT_TTL_S = 7 * 24 * 3600.0

app = FastAPI(title="kvgrid tenant gateway")


MAX_GROUP_RETRIES = 2  # other groups tried after a group fails under a request


class _GroupFailed(Exception):
    """The worker group running a request failed (died or lost a rank)."""


class ApiError(Exception):
    """An error answered in the calling API's own format."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", api: str = "openai",
                 retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.api = status, message, kind, api
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        if self.api == "anthropic":
            body: dict[str, Any] = {"type": "error", "error": {"type": self.kind, "message": self.message}}
        else:
            body = {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.status}}
        headers = {"Retry-After": str(max(1, math.ceil(self.retry_after)))} if self.status in (429, 503) else None
        return JSONResponse(body, status_code=self.status, headers=headers)


@app.exception_handler(ApiError)
async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


def _api_of(path: str) -> str:
    return "anthropic" if path.endswith("/messages") else "openai"


_KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def _err(status: int, message: str, api: str, retry_after: float = 1.0) -> ApiError:
    kind = _KINDS.get(status, "api_error")
    if api == "openai" and status == 401:
        kind = "invalid_request_error"
    return ApiError(status, message, kind, api, retry_after)


class _Metrics:
    def __init__(self, tenant: str) -> None:
        self.registry = CollectorRegistry()
        r, lbl = self.registry, ["tenant"]
        self.requests = Counter("kvgrid_requests", "Requests served", lbl, registry=r)
        self.prompt = Counter("kvgrid_prompt_tokens", "Prompt tokens", lbl, registry=r)
        self.cached = Counter("kvgrid_cached_tokens", "Prompt tokens served from the prefix cache", lbl, registry=r)
        self.output = Counter("kvgrid_output_tokens", "Output tokens", lbl, registry=r)
        self.hit_rate = Gauge("kvgrid_prefix_hit_rate", "Cached / prompt tokens so far", lbl, registry=r)
        self.predicted = Counter("kvgrid_router_predicted_cached_tokens", "Cached tokens the router expected", lbl,
                                 registry=r)
        self.actual = Counter("kvgrid_router_actual_cached_tokens", "Cached tokens the group reported", lbl,
                              registry=r)
        self.tenant = tenant
        self._prompt_total = self._cached_total = 0

    def record(self, prompt: int, cached: int, output: int, predicted: int, actual: int) -> None:
        """``cached``: the reuse reported to the client (the tenant's policy); ``actual``: what the group reused,
        against which the router's ``predicted`` is judged."""
        t = self.tenant
        self.requests.labels(t).inc()
        self.prompt.labels(t).inc(prompt)
        self.cached.labels(t).inc(cached)
        self.output.labels(t).inc(output)
        self.predicted.labels(t).inc(predicted)
        self.actual.labels(t).inc(actual)
        self._prompt_total += prompt
        self._cached_total += cached
        self.hit_rate.labels(t).set(self._cached_total / max(1, self._prompt_total))


def _failure(exc: RayError, group: str, api: str) -> Exception:
    """What a failed output of a group means: a bad request (400), an abort (503), the group itself failing (a
    retry elsewhere), or an error of this one request (500; the group keeps serving everyone else)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ValueError):
        return _err(400, str(cause), api)
    name = type(cause).__name__
    if name == "RequestAborted":
        return _err(503, "the request was aborted on its worker group; retry it", api)
    if isinstance(exc, RayActorError) or name == "GroupUnhealthyError":
        return _GroupFailed(f"{type(exc).__name__}: {cause or exc}")
    return ApiError(500, f"internal error in worker group {group} ({name or type(exc).__name__})", "api_error", api)


def _no_account(out: RequestOutput, predicted: int) -> None:
    """Internal requests (computing cached content) are recorded by their callers."""


async def _primed(run):
    """Start ``run`` now (so its first error surfaces before a response is sent) and return an equivalent."""
    first = await run.__anext__()

    async def rest():
        yield first
        async for item in run:
            yield item

    return rest()


async def _last(run) -> tuple[RequestOutput, int]:
    out = None
    async for out in run:
        pass
    assert out is not None
    return out


def _openai_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def _anthropic_blocks(m: AnthropicMessage) -> list[ContentBlock]:
    return [ContentBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content


def _stop_reason(out: RequestOutput) -> str:
    if out.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if isinstance(out.stop_reason, str) else "end_turn"


# Serve captures this class when it is decorated: every module-level name it uses must be defined above.
@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class Gateway:
    def __init__(
        self, tenant: TenantConfig, config: ServeConfig, model_path: str, routers: list, redis_url: str
    ) -> None:
        self.tenant, self.config = tenant, config
        self.model_id = config.model_id
        self.tokenizer = load_tokenizer(model_path)
        mcfg = ModelConfig.from_folder(model_path)  # the same limit the engine enforces
        self.max_model_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        self.routers = list(routers)  # the RouterService replicas; each request stays with the one that routed it
        self._next_router = secrets.randbelow(len(self.routers))
        self.redis = redis.Redis.from_url(redis_url)
        self.keys = TenantStore(self.redis)
        self.ledger = UsageLedger(self.redis)
        self.contents = CachedContentStore(self.redis)
        self.limiter = RateLimiter(self.redis, tenant.limits.requests_per_s, tenant.limits.tokens_per_min)
        self.metrics = _Metrics(tenant.name)

    # -- plumbing ----------------------------------------------------------------------------------------------

    async def _body(self, request: Request, model: type[BaseModel], api: str) -> Any:
        if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
            raise _err(413, f"request body exceeds {MAX_BODY_BYTES} bytes", api)
        chunks, size = [], 0
        async for chunk in request.stream():  # a chunked upload has no length: stop reading past the limit
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise _err(413, f"request body exceeds {MAX_BODY_BYTES} bytes", api)
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise _err(400, f"{where}: {first['msg']}", api) from None

    def _auth(self, request: Request, api: str) -> None:
        key = request.headers.get("x-api-key") or request.headers.get("x-goog-api-key")
        auth = request.headers.get("authorization", "")
        if not key and auth.lower().startswith("bearer "):
            key = auth[7:].strip()
        if not self.keys.authenticate(self.tenant.name, key):
            raise _err(401, "invalid API key for this tenant", api)

    def _check_model(self, model: str, api: str) -> None:
        if model != self.model_id:
            raise _err(404, f"model {model!r} does not exist; this gateway serves {self.model_id!r}", api)

    def _encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _chat_text(self, messages: list[dict[str, str]]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except TemplateError as exc:
            raise _err(400, f"messages: {exc}", "openai") from None

    def _cached_prefix(self, cid: str | None, api: str) -> tuple[list[int], float]:
        """Token ids and remaining TTL of a referenced cached content object."""
        if cid is None:
            return [], 0.0
        cc = self.contents.get(self.tenant.name, cid if cid.startswith("cachedContents/") else f"cachedContents/{cid}")
        if cc is None:
            raise _err(404, f"cached content {cid!r} not found", api)
        return cc.token_ids, max(1.0, cc.expires - time.time())

    def _params(self, max_tokens: int, temperature: float, top_p: float, stop, seed, api: str, top_k: int = 0):
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                stop=stop or [], seed=seed,
            )
        except ValueError as exc:
            raise _err(400, str(exc), api) from None

    def _admit(self, prompt: list[int], max_tokens: int, api: str) -> None:
        """Check the prompt's length and the tenant's limits before any work is done for it."""
        if not prompt:
            raise _err(400, "the prompt is empty", api)
        if len(prompt) >= self.max_model_len:
            raise _err(413, f"the prompt has {len(prompt)} tokens; the context is {self.max_model_len}", api)
        lim = self.tenant.limits
        if lim.max_prompt_tokens is not None and len(prompt) > lim.max_prompt_tokens:
            raise _err(413, f"the prompt has {len(prompt)} tokens; this tenant may send {lim.max_prompt_tokens}",
                       api)
        if lim.tokens_per_min is not None and len(prompt) + max_tokens > lim.tokens_per_min:
            raise _err(413, f"the prompt and max tokens ({len(prompt) + max_tokens}) exceed this tenant's "
                       f"{lim.tokens_per_min} tokens per minute", api)
        retry_after = self.limiter.admit(self.tenant.name, len(prompt) + max_tokens)
        if retry_after is not None:
            raise _err(429, "rate limit reached for this tenant; retry later", api, retry_after)

    def _reported_cached(self, num_cached: int) -> int:
        """Implicit tenants see reuse from ``min_prefix_tokens`` up; explicit tenants see all of it."""
        c = self.tenant.cache
        return num_cached if c.mode == "explicit" or num_cached >= c.min_prefix_tokens else 0

    async def _generate(
        self, prompt: list[int], params: SamplingParams, api: str, pin_tokens: int, pin_ttl_s: float, account,
        restartable: bool = False,
    ) -> AsyncIterator[tuple[RequestOutput, int]]:
        """Route and run one request; yields (output, tokens the router expected cached). However it ends
        (finished, failed, or the client went away), ``account(last output, predicted)`` records its usage
        once, and an unfinished request is aborted on its group.

        A group that fails is reported to the router (which routes nothing more to it) and the request is
        retried on another group, as long as nothing has been yielded yet, or at any point when
        ``restartable`` (the caller keeps only the last output)."""
        failed: list[str] = []
        self._next_router = (self._next_router + 1) % len(self.routers)
        router = self.routers[self._next_router]
        rid = f"{self.tenant.name}-{secrets.token_hex(8)}"  # unique across router replicas and gateways
        while True:
            attempt = f"{rid}-{len(failed)}"
            decision = out = None
            yielded = finished = False
            try:
                try:
                    decision = await router.route.remote(self.tenant.name, prompt, attempt, failed)
                except RayError as exc:
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, Overloaded):
                        raise _err(429, f"overloaded: {cause}; retry shortly", api) from None
                    detail = str(cause) if isinstance(cause, NoGroup) else type(exc).__name__
                    raise _err(503, f"no worker group available ({detail}); retry shortly", api) from None
                gen = decision.leader.generate.remote(
                    prompt, params, self.tenant.name, attempt, pin_tokens, pin_ttl_s)
                async for ref in gen:
                    try:
                        out = await ref
                    except RayError as exc:
                        raise _failure(exc, decision.group, api) from None
                    if not finished and len(out.token_ids) == len(out.new_token_ids):
                        router.on_prefill_done.remote(attempt)
                    finished = out.finished
                    yielded = True
                    yield out, decision.cached_tokens
                return
            except _GroupFailed as exc:
                for r in self.routers:  # no replica should send more requests there
                    r.report_failure.remote(decision.group, str(exc))
                failed.append(decision.group)
                if (yielded and not restartable) or len(failed) > MAX_GROUP_RETRIES:
                    raise _err(503, f"worker group {decision.group} failed during the request; retry it",
                               api) from None
                out = None  # nothing of the failed attempt is billed: the retry starts over
            finally:
                router.on_finish.remote(attempt)  # also when the client left during routing
                if decision is not None and not finished:
                    decision.leader.abort.remote(attempt)
                if out is not None:
                    account(out, decision.cached_tokens)

    def _account(self, out: RequestOutput, predicted: int, cached: int, write: int = 0, read: int = 0) -> None:
        n_prompt = len(out.prompt_token_ids)
        self.ledger.record(
            self.tenant.name, requests=1, prompt_tokens=n_prompt, cached_tokens=cached,
            output_tokens=len(out.token_ids), cache_write_tokens=write, cache_read_tokens=read,
        )
        self.metrics.record(n_prompt, cached, len(out.token_ids), predicted, out.num_cached_tokens)

    def _account_openai(self, out: RequestOutput, predicted: int) -> None:
        self._account(out, predicted, self._reported_cached(out.num_cached_tokens))

    # -- OpenAI ------------------------------------------------------------------------------------------------

    @app.get("/v1/models")
    async def models(self, request: Request):
        self._auth(request, "openai")
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": 0,
                                            "owned_by": "kvgrid"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        self._auth(request, "openai")
        body: ChatRequest = await self._body(request, ChatRequest, "openai")
        self._check_model(body.model, "openai")
        if body.n != 1:
            raise _err(400, "n must be 1", "openai")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": _openai_text(m.content)}
                    for m in body.messages]
        prefix, ttl = self._cached_prefix(body.cached_content, "openai")
        prompt = prefix + self._encode_text(self._chat_text(messages))
        max_tokens = body.max_completion_tokens or body.max_tokens or 256
        return await self._openai_respond(body, prompt, len(prefix), ttl, max_tokens, chat=True)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        self._auth(request, "openai")
        body: CompletionRequest = await self._body(request, CompletionRequest, "openai")
        self._check_model(body.model, "openai")
        if body.n != 1:
            raise _err(400, "n must be 1", "openai")
        prefix, ttl = self._cached_prefix(body.cached_content, "openai")
        tokens = self._encode_text(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        if any(not 0 <= t < len(self.tokenizer) for t in tokens):
            raise _err(400, "prompt: token id outside the vocabulary", "openai")
        return await self._openai_respond(body, prefix + tokens, len(prefix), ttl, body.max_tokens, chat=False)

    async def _openai_respond(self, body, prompt: list[int], pin: int, ttl: float, max_tokens: int, chat: bool):
        """Run a chat or text completion and answer it, streamed or whole."""
        self._admit(prompt, max_tokens, "openai")
        params = self._params(max_tokens, body.temperature, body.top_p, body.stop, body.seed, "openai")
        run = self._generate(prompt, params, "openai", pin, ttl or 300.0, self._account_openai, not body.stream)
        rid, created = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12), int(time.time())
        if body.stream:
            usage_wanted = bool((body.stream_options or {}).get("include_usage"))
            run = await _primed(run)  # errors before the first token still get their HTTP status
            obj = "chat.completion.chunk" if chat else "text_completion"
            return StreamingResponse(
                self._openai_stream(run, rid, created, obj, usage_wanted, chat), media_type="text/event-stream"
            )
        out, _ = await _last(run)
        cached = self._reported_cached(out.num_cached_tokens)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "finish_reason": out.finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": out.text, "finish_reason": out.finish_reason, "logprobs": None}
        return {
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": self.model_id, "choices": [choice], "usage": self._openai_usage(out, cached),
        }

    def _openai_usage(self, out: RequestOutput, cached: int) -> dict[str, Any]:
        n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def _openai_stream(self, run, rid: str, created: int, obj: str, usage_wanted: bool, chat: bool):
        def chunk(choice: dict | None, usage: dict | None = None) -> str:
            payload = {"id": rid, "object": obj, "created": created, "model": self.model_id,
                       "choices": [choice] if choice else []}
            if usage is not None:
                payload["usage"] = usage
            return f"data: {json.dumps(payload)}\n\n"

        try:
            if chat:
                yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            out = None
            async for out, _ in run:
                if out.delta_text or out.finished:
                    delta = {"content": out.delta_text} if chat else None
                    choice = ({"index": 0, "delta": delta, "finish_reason": out.finish_reason} if chat else
                              {"index": 0, "text": out.delta_text, "finish_reason": out.finish_reason})
                    yield chunk(choice)
            if out is not None and usage_wanted:
                yield chunk(None, self._openai_usage(out, self._reported_cached(out.num_cached_tokens)))
        except ApiError as exc:
            yield f"data: {json.dumps({'error': {'message': exc.message, 'type': exc.kind}})}\n\n"
        yield "data: [DONE]\n\n"

    # -- Anthropic ---------------------------------------------------------------------------------------------

    @app.post("/v1/messages")
    async def messages(self, request: Request):
        self._auth(request, "anthropic")
        body: MessagesRequest = await self._body(request, MessagesRequest, "anthropic")
        self._check_model(body.model, "anthropic")
        prefix, cc_ttl = self._cached_prefix(body.cached_content, "anthropic")
        text, marks = self._anthropic_prompt(body)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        prompt = prefix + ids
        self._admit(prompt, body.max_tokens, "anthropic")
        # Breakpoint = the tokens ending at or before the marked block's end; only whole blocks are pinned.
        bs = self.config.block_size
        ttl_at: dict[int, float] = {}
        for char_end, ttl in marks:
            pos = (len(prefix) + sum(1 for _, end in offsets if end <= char_end)) // bs * bs
            if pos > 0:
                ttl_at[pos] = max(ttl, ttl_at.get(pos, 0.0))
        pin_tokens = max(ttl_at, default=len(prefix))
        pin_ttl = max(ttl_at.values(), default=cc_ttl or self.tenant.cache.default_ttl)
        entries = {pos: self._entry_key(prompt[:pos]) for pos in ttl_at}
        # Read: the longest marked prefix whose entry lives (cached content is pinned already); the rest is
        # written now.
        read = len(prefix) // bs * bs
        for pos in sorted(entries, reverse=True):
            if pos > read and self.redis.exists(entries[pos]):
                read = pos
                break
        write = max(0, pin_tokens - read) if entries else 0
        params = self._params(body.max_tokens, body.temperature, body.top_p, body.stop_sequences, None,
                              "anthropic", body.top_k)

        def account(out: RequestOutput, predicted: int) -> None:
            usage = self._anthropic_usage(out, write, read)
            r, w = usage["cache_read_input_tokens"], usage["cache_creation_input_tokens"]
            self._account(out, predicted, r, w, r)
            if out.finished and out.finish_reason != "abort":  # the entries exist once the pin does
                for pos, key in entries.items():
                    self._keep_entry(key, ttl_at[pos])

        run = self._generate(prompt, params, "anthropic", pin_tokens, pin_ttl, account, not body.stream)
        mid = "msg_" + secrets.token_hex(12)
        if body.stream:
            run = await _primed(run)
            return StreamingResponse(self._anthropic_stream(run, mid, write, read), media_type="text/event-stream")
        out, _ = await _last(run)
        return {
            "id": mid, "type": "message", "role": "assistant", "model": self.model_id,
            "content": [{"type": "text", "text": out.text}], "stop_reason": _stop_reason(out),
            "stop_sequence": out.stop_reason if isinstance(out.stop_reason, str) else None,
            "usage": self._anthropic_usage(out, write, read),
        }

    def _entry_key(self, tokens: list[int]) -> str:
        return f"kvgrid:pin:{self.tenant.name}:{xxhash.xxh3_128_hexdigest(token_bytes(tokens))}"

    def _keep_entry(self, key: str, ttl_s: float) -> None:
        """Create or refresh an explicit entry; a shorter TTL never cuts a longer one."""
        ms = int(ttl_s * 1000)
        if self.redis.pttl(key) < ms:
            self.redis.set(key, 1, px=ms)

    def _render(self, messages: list[dict[str, str]]) -> str:
        if not messages:
            return ""
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
        except TemplateError as exc:
            raise _err(400, f"messages: {exc}", "anthropic") from None

    def _anthropic_prompt(self, body: MessagesRequest) -> tuple[str, list[tuple[int, float]]]:
        """The chat text, and (character end, TTL) of each ``cache_control`` breakpoint in it."""
        marked: list[tuple[int, str, float]] = []  # (message index, text, ttl)

        def ttl(cc) -> float:
            try:
                seconds = parse_duration(cc.ttl) if cc.ttl else self.tenant.cache.default_ttl
            except ValueError as exc:
                raise _err(400, f"cache_control.ttl: {exc}", "anthropic") from None
            if not 1.0 <= seconds <= MAX_PIN_TTL_S:
                raise _err(400, f"cache_control.ttl must be between 1s and {MAX_PIN_TTL_S:.0f}s", "anthropic")
            return seconds

        system_parts: list[str] = []
        for tool in body.tools or []:
            spec = json.dumps({"name": tool.name, "description": tool.description, "input_schema": tool.input_schema})
            system_parts.append(spec)
            if tool.cache_control:
                marked.append((0, spec, ttl(tool.cache_control)))
        blocks = [ContentBlock(type="text", text=body.system)] if isinstance(body.system, str) else body.system or []
        for b in blocks:
            system_parts.append(b.text or "")
            if b.cache_control:
                marked.append((0, b.text or "", ttl(b.cache_control)))
        messages = [{"role": "system", "content": "\n".join(system_parts)}] if system_parts else []
        for m in body.messages:
            parts = _anthropic_blocks(m)
            idx = len(messages)
            messages.append({"role": m.role, "content": "".join(b.text or "" for b in parts)})
            marked.extend((idx, b.text or "", ttl(b.cache_control)) for b in parts if b.cache_control)
        if len(marked) > MAX_BREAKPOINTS:
            raise _err(400, f"at most {MAX_BREAKPOINTS} cache_control breakpoints are allowed", "anthropic")
        text = self._chat_text(messages)
        marks, pos = [], 0
        for idx, piece, seconds in marked:
            # Search from where the block's own message starts, so equal text earlier cannot match.
            start = max(pos, len(self._render(messages[:idx])))
            at = text.find(piece, start)
            if at < 0:
                piece = piece.strip()  # templates that trim content
                at = text.find(piece, start)
            if at < 0:
                raise _err(400, "a cache_control block could not be located in the prompt", "anthropic")
            pos = at + len(piece)
            marks.append((pos, seconds))
        return text, marks

    def _anthropic_usage(self, out: RequestOutput, write: int, read: int) -> dict[str, int]:
        n_prompt = len(out.prompt_token_ids)
        if not write and not read:  # no breakpoint: implicit reuse, reported per the tenant's policy
            read = self._reported_cached(out.num_cached_tokens)
        else:
            write = min(write, max(0, out.num_pinned_tokens - read))  # what the group could pin
            read += max(0, out.num_cached_tokens - read - write)  # reuse past the breakpoint, honestly
        return {"input_tokens": n_prompt - write - read, "cache_creation_input_tokens": write,
                "cache_read_input_tokens": read, "output_tokens": len(out.token_ids)}

    async def _anthropic_stream(self, run, mid: str, write: int, read: int):
        def event(kind: str, data: dict) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

        try:
            first = True
            out = None
            async for out, _ in run:
                if first:
                    start_usage = {"input_tokens": len(out.prompt_token_ids) - write - read, "output_tokens": 0,
                                   "cache_creation_input_tokens": write, "cache_read_input_tokens": read}
                    yield event("message_start", {"message": {
                        "id": mid, "type": "message", "role": "assistant", "model": self.model_id, "content": [],
                        "stop_reason": None, "stop_sequence": None, "usage": start_usage}})
                    yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                    first = False
                if out.delta_text:
                    yield event("content_block_delta",
                                {"index": 0, "delta": {"type": "text_delta", "text": out.delta_text}})
            if out is not None:
                stop_seq = out.stop_reason if isinstance(out.stop_reason, str) else None
                yield event("content_block_stop", {"index": 0})
                yield event("message_delta", {"delta": {"stop_reason": _stop_reason(out), "stop_sequence": stop_seq},
                                              "usage": self._anthropic_usage(out, write, read)})
                yield event("message_stop", {})
        except ApiError as exc:
            yield event("error", {"error": {"type": exc.kind, "message": exc.message}})

    # -- cached content ----------------------------------------------------------------------------------------

    @app.post("/v1/cachedContents")
    async def create_cached_content(self, request: Request):
        self._auth(request, "openai")
        body: CachedContentRequest = await self._body(request, CachedContentRequest, "openai")
        if body.model is not None:
            self._check_model(body.model.removeprefix("models/"), "openai")
        text = gemini_text(body.systemInstruction) + "".join(gemini_text(c) for c in body.contents or [])
        if not text:
            raise _err(400, "contents: a cached content needs some text", "openai")
        ttl = self._ttl(body.ttl)
        tokens = self._encode_text(self.tokenizer.apply_chat_template(
            [{"role": "system", "content": text}], add_generation_prompt=False, tokenize=False))
        self._admit(tokens, 1, "openai")
        limit = self.tenant.cache.max_pinned_tokens
        if limit is not None and len(tokens) > limit:
            raise _err(400, f"the content has {len(tokens)} tokens; this tenant may pin {limit}", "openai")
        # Compute and pin it now, so the first use is already a read.
        await _last(self._generate(tokens, SamplingParams(max_tokens=1, temperature=0.0), "openai", len(tokens), ttl,
                                   _no_account, True))
        cc = self.contents.create(self.tenant.name, {"text": text}, tokens, ttl)
        self.ledger.record(self.tenant.name, cache_write_tokens=len(tokens))
        return cc.public()

    def _ttl(self, ttl: str | None) -> float:
        try:
            seconds = parse_duration(ttl) if ttl else self.tenant.cache.default_ttl
        except ValueError as exc:
            raise _err(400, f"ttl: {exc}", "openai") from None
        if not 1.0 <= seconds <= MAX_CACHED_CONTENT_TTL_S:
            raise _err(400, f"ttl must be between 1s and {MAX_CACHED_CONTENT_TTL_S:.0f}s", "openai")
        return seconds

    @app.get("/v1/cachedContents")
    async def list_cached_contents(self, request: Request):
        self._auth(request, "openai")
        return {"cachedContents": [c.public() for c in self.contents.list(self.tenant.name)]}

    @app.get("/v1/cachedContents/{cid}")
    async def get_cached_content(self, cid: str, request: Request):
        self._auth(request, "openai")
        cc = self.contents.get(self.tenant.name, f"cachedContents/{cid}")
        if cc is None:
            raise _err(404, f"cached content {cid!r} not found", "openai")
        return cc.public()

    @app.patch("/v1/cachedContents/{cid}")
    async def patch_cached_content(self, cid: str, request: Request):
        self._auth(request, "openai")
        body: CachedContentPatch = await self._body(request, CachedContentPatch, "openai")
        ttl = self._ttl(body.ttl)
        cc = self.contents.set_ttl(self.tenant.name, f"cachedContents/{cid}", ttl)
        if cc is None:
            raise _err(404, f"cached content {cid!r} not found", "openai")
        await _last(self._generate(cc.token_ids, SamplingParams(max_tokens=1, temperature=0.0), "openai",
                                   len(cc.token_ids), ttl, _no_account, True))  # re-pin for the new lifetime
        return cc.public()

    @app.delete("/v1/cachedContents/{cid}")
    async def delete_cached_content(self, cid: str, request: Request):
        self._auth(request, "openai")
        if not self.contents.delete(self.tenant.name, f"cachedContents/{cid}"):
            raise _err(404, f"cached content {cid!r} not found", "openai")
        return {}

    # -- metrics -----------------------------------------------------------------------------------------------

    @app.get("/metrics")
    async def metrics(self, request: Request):
        """This tenant's own counters only: worker-group load moves with every tenant's traffic, so it is on the
        admin API (``/admin/v1/metrics``), never here."""
        self._auth(request, "openai")
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)
