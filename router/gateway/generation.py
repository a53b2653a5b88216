"""Running one request on a worker group (``Generation.generate``): routed through the router replicas
(router/gateway/router_pool.py), streamed from the group's ``GroupClient``, retried on another group when its group
fails, and accounted once however it ends. A request is one ``GenerateRequest``."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from common.errors import GroupUnhealthyError
from common.lora import AdapterRef
from common.outputs import RequestOutput, Timings, merge_choices
from common.protocol import Submit
from common.sampling import SamplingParams
from router.clients import RouterClient
from router.gateway.access import current as current_access
from router.gateway.errors import GroupFailed, err, group_failure
from router.gateway.monitoring import RequestTiming
from router.gateway.router_pool import RouterPool
from router.gateway.runs import Account, Run, no_account
from router.gateway.tenants import Tenant
from router.gateway.tracing import current_trace
from router.routing.router import RouteDecision
from worker.group_client import GroupClient

MAX_GROUP_RETRIES = 2  # other groups tried after a group fails under a request
GROUP_SILENCE_S = 60.0  # a request without output for this long makes the gateway ask its group's health
HEALTH_TIMEOUT_S = 10.0


@dataclass
class GenerateRequest:
    """One request to run: the tenant's ``prompt`` with its sampling ``params``; errors in ``api``'s format; the
    first ``pin_tokens`` of the prompt pinned on the group for ``pin_ttl_s``; ``account(last output, predicted)``
    records its usage once it ends; ``restartable``: the caller keeps only the last output, so a failed group may
    be retried at any point; ``n`` choices; ``cache_key`` (OpenAI's ``prompt_cache_key``) routed by; ``adapter``:
    the LoRA adapter it runs under."""

    tenant: Tenant
    prompt: list[int]
    params: SamplingParams
    api: str
    pin_tokens: int = 0
    pin_ttl_s: float = 0.0
    account: Account = field(default=no_account)
    restartable: bool = False
    n: int = 1
    cache_key: str | None = None
    adapter: AdapterRef | None = None  # the tenant's LoRA adapter it runs under (none: the base model)


async def _outputs(client: GroupClient, req: Submit, api: str) -> AsyncGenerator[RequestOutput, None]:
    """A group's outputs for one request, its errors as the gateway answers them. A request may wait in a busy
    group's queue for long, so silence alone is no failure: every ``GROUP_SILENCE_S`` without output the leader
    is asked whether the group is healthy (a hung step fails it after ``step_timeout_s``); a group that is
    unhealthy or does not answer has failed."""

    async def silent() -> None:
        try:
            reason = await client.ahealth(HEALTH_TIMEOUT_S)
        except (GroupUnhealthyError, TimeoutError) as exc:
            reason = (
                f"no output for {GROUP_SILENCE_S:.0f} s and no health answer ({type(exc.__cause__ or exc).__name__})"
            )
        if reason is not None:
            raise GroupFailed(reason)

    stream = client.astream(req, silent, GROUP_SILENCE_S)
    try:
        async for out in stream:
            yield out
    except GroupFailed:
        raise
    except Exception as exc:
        raise group_failure(exc, client.group, api) from None
    finally:  # a consumer that stops early aborts the request now, not when the stream is collected
        await stream.aclose()


class Generation:
    """Runs requests for one gateway replica: its router replicas (``pool``), one ``GroupClient`` per group (its
    leader's subscription carries the deltas of all this replica's requests there), the KV block size (for the
    route span of a trace) and whether per-request metrics are on."""

    def __init__(self, pool: RouterPool, block_size: int, metrics_on: bool) -> None:
        self.pool, self.block_size, self.metrics_on = pool, block_size, metrics_on
        self._clients: dict[str, GroupClient] = {}  # group -> the client of its leader

    def _client(self, decision: RouteDecision) -> GroupClient:
        """The client of the decision's group, whose one subscription per replica carries the deltas of all its
        requests there, once per step (a new client for a restarted group's new leader)."""
        client = self._clients.get(decision.group)
        if client is None or client.leader != decision.leader:
            client = self._clients[decision.group] = GroupClient(decision.group, decision.leader)
        return client

    async def generate(self, req: GenerateRequest) -> Run:
        """Route and run one request; yields (output, tokens the router expected cached). However it ends
        (finished, failed, or the client went away), ``req.account(last output, predicted)`` records its usage
        once, and an unfinished request is aborted on its group (by its ``GroupClient`` stream).

        A group that fails (or is silent and unhealthy, see ``_outputs``) is reported to the routers (which route
        nothing more to it) and the request is retried on another group, as long as nothing has been yielded
        yet, or at any point when ``req.restartable`` (the caller keeps only the last output). A request the
        engine failed alone answers 500; its group keeps serving.

        ``req.n`` > 1: the prompt's ``n`` choices, computed once on one group; their outputs come interleaved (each
        with its ``index``) until every choice has finished, and ``account`` gets them merged (the prompt once,
        the completion tokens of all). ``req.cache_key`` (OpenAI's ``prompt_cache_key``) is routed by
        (``Router.route``)."""
        t, prompt, api, n, cache_key, account = req.tenant, req.prompt, req.api, req.n, req.cache_key, req.account
        adapter = None if req.adapter is None else req.adapter.id
        failed: list[str] = []
        rid = f"{t.name}-{secrets.token_hex(8)}"  # unique across router replicas and gateways
        timing = RequestTiming(time.monotonic())  # latencies as the client sees them, retries included
        acc = current_access() if account is not no_account else None  # the access log's record of the request
        rt = current_trace()  # the request's trace (router/gateway/tracing.py), when tracing is on
        while True:
            attempt = f"{rid}-{len(failed)}"
            router: RouterClient | None = None
            decision: RouteDecision | None = None
            out: RequestOutput | None = None
            lasts: dict[int, RequestOutput] = {}  # n > 1: each choice's latest output
            finals: list[tuple[int, RequestOutput]] | None = None if rt is None else []  # (arrived, final output)
            timings: list[Timings] = []  # the engine's, of each choice's final output
            yielded = finished = False
            try:
                route = self.pool.route(t.name, prompt, attempt, failed, api, cache_key, n, adapter)
                if rt is None:
                    router, decision = await route
                else:
                    routed = time.time_ns()
                    try:
                        router, decision = await route
                    except BaseException as exc:
                        rt.route_span(routed, None, self.block_size, len(failed), exc)
                        raise
                    rt.route_span(routed, decision, self.block_size, len(failed))
                submit = Submit(prompt, req.params, t.name, attempt, req.pin_tokens, req.pin_ttl_s, n, req.adapter)
                left = n
                async for out in _outputs(self._client(decision), submit, api):
                    if not yielded and len(out.token_ids) == len(out.new_token_ids):
                        self.pool.reports.add(router, "prefill_done", attempt)
                    if n > 1:
                        lasts[out.index] = out
                    left -= out.finished
                    finished = left == 0
                    yielded = True
                    if out.finished:
                        if out.timings is not None:
                            timings.append(out.timings)
                        if finals is not None:
                            finals.append((time.time_ns(), out))
                    timing.tick(time.monotonic(), len(out.new_token_ids))
                    if acc is not None and out.new_token_ids:
                        acc.first_token()
                    yield out, decision.cached_tokens
                    if finished:
                        break
                return
            except GroupFailed as exc:
                assert decision is not None  # only the group's stream raises it, after routing
                self.pool.report_failure(decision.group, str(exc))
                failed.append(decision.group)
                if (yielded and not req.restartable) or len(failed) > MAX_GROUP_RETRIES:
                    raise err(503, f"worker group {decision.group} failed during the request; retry it", api) from None
                out = None  # nothing of the failed attempt is billed: the retry starts over
            finally:
                if router is not None:
                    self.pool.reports.add(router, "finish", attempt)  # also when the client left during routing
                if rt is not None and finals and decision is not None:  # queue, prefill, decode: the engine's timings
                    rt.group_spans(decision.group, finals)
                if out is not None and decision is not None:  # an output came from the routed group
                    account(merge_choices(list(lasts.values())) if lasts else out, decision.cached_tokens)
                if finished and account is not no_account and self.metrics_on:  # internal ones: not the tenant's
                    timing.finish(time.monotonic())
                    t.metrics.observe(timing)
                    if decision is not None and out is not None:
                        t.metrics.observe_group(
                            timings, out.num_cached_tokens, decision.host_tokens, decision.disk_tokens
                        )
