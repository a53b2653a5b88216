"""What crosses the boundary between a worker group's leader (rank 0) and its callers, and the caller's side of it.

A request is sent with one unary ``submit`` call (a ``Submit``). Its outputs come back as ``Delta``s: only what
changed in a step (new token ids, new text, new logprobs, the finish), never the prompt or the tokens so far. A
caller with many requests on a group (a gateway replica) holds one subscription to the leader, a Ray streaming
call that yields at most one message per engine step, carrying the deltas of all of that caller's requests;
``GroupLink`` reads it, fans the deltas out to each request's stream and rebuilds the cumulative
``RequestOutput`` the caller reads (``Outputs``: incrementally, never copying what came before). One message per
step instead of one Ray object per request per token is what keeps a busy group's outputs from queueing behind
Ray's per-object overhead.

The leader ends a subscription when it fails (its requests then fail with ``GroupUnhealthyError``); when the
subscriber dies, Ray closes the subscription (it is read with backpressure, which is what makes Ray notice a
dead reader), and the leader aborts that subscriber's requests.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from common.outputs import RequestOutput
from common.sampling import SamplingParams


class RequestAborted(RuntimeError):
    """The request was aborted on the group (by another caller) before it finished."""


class GroupUnhealthyError(RuntimeError):
    """The group lost a rank (or its leader failed); its requests fail and it must be restarted."""


class RequestFailed(RuntimeError):
    """The engine failed this one request (sampling, detokenizing or stop checking it raised); the group and
    every other request keep running."""


# Unconsumed subscription messages the leader may run ahead by. It must be bounded: only a bounded stream makes
# Ray close the leader's side when the subscriber dies. A slow reader is not slowed further: the leader keeps
# collecting its deltas and sends them together.
SUBSCRIPTION_BACKPRESSURE = 8
HEARTBEAT_S = 5.0  # an idle subscription still yields this often, so a dead subscriber is noticed when idle too


@dataclass
class Submit:
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    tenant: str = "default"
    request_id: str | None = None  # None: the leader names it
    pin_tokens: int = 0
    pin_ttl_s: float = 300.0


@dataclass(slots=True)
class Delta:
    """One request's increment in one engine step. ``aborted``: another caller aborted it; ``error``: the engine
    failed this request alone."""

    request_id: str
    new_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    num_pinned_tokens: int
    logprobs: list[float] | None = None  # of the new tokens
    top_logprobs: list[dict[int, float]] | None = None
    ttft: float | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    aborted: bool = False

    @classmethod
    def of(cls, out: RequestOutput) -> Delta:
        n_old = len(out.token_ids) - len(out.new_token_ids)
        return cls(
            out.request_id, out.new_token_ids, out.delta_text, out.finished, out.finish_reason,
            out.num_cached_tokens, out.num_pinned_tokens,
            None if out.logprobs is None else out.logprobs[n_old:],
            None if out.top_logprobs is None else out.top_logprobs[n_old:],
            out.ttft, out.stop_reason, out.error,
        )

    @classmethod
    def abort(cls, request_id: str) -> Delta:
        return cls(request_id, [], "", True, "abort", 0, 0, aborted=True)


class _StreamedOutput(RequestOutput):
    """A ``RequestOutput`` of a stream whose text is joined from the stream's chunks when first read: a stream
    that nobody reads the whole text of mid-way (the gateway reads ``delta_text``) never copies it per step."""

    _text: str | None

    def __init__(self, *args, chunks: list[str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._chunks, self._n = chunks, len(chunks)  # this output's text: the first ``_n`` chunks

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = "".join(self._chunks[:self._n])
        return self._text

    @text.setter
    def text(self, value: str | None) -> None:
        self._text = value


class Outputs:
    """One request's cumulative outputs, built delta by delta in time linear in its length. Every output of a
    stream shares its ``token_ids`` / ``logprobs`` / ``top_logprobs`` lists, extended in place: each holds the
    values of the latest step when read as it is yielded (copy one to keep a step's values); ``text`` is the
    output's own (joined when read)."""

    def __init__(self, req: Submit, request_id: str) -> None:
        self.request_id, self.tenant, self.prompt = request_id, req.tenant, req.prompt
        self.token_ids: list[int] = []
        self.chunks: list[str] = []
        self.logprobs: list[float] | None = None
        self.top_logprobs: list[dict[int, float]] | None = None

    def advance(self, d: Delta) -> RequestOutput:
        """The cumulative output after delta ``d``; raises ``RequestAborted`` or ``RequestFailed`` for those
        ends."""
        if d.aborted:
            raise RequestAborted(f"request {d.request_id} was aborted")
        if d.error is not None:
            raise RequestFailed(f"request {d.request_id} failed: {d.error}")
        self.token_ids.extend(d.new_token_ids)
        if d.delta_text:
            self.chunks.append(d.delta_text)
        if d.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(d.logprobs)
        if d.top_logprobs is not None:
            if self.top_logprobs is None:
                self.top_logprobs = []
            self.top_logprobs.extend(d.top_logprobs)
        return _StreamedOutput(
            request_id=self.request_id, tenant=self.tenant, prompt_token_ids=self.prompt,
            token_ids=self.token_ids, text=None, new_token_ids=d.new_token_ids, delta_text=d.delta_text,
            finished=d.finished, finish_reason=d.finish_reason, num_cached_tokens=d.num_cached_tokens,
            num_pinned_tokens=d.num_pinned_tokens,
            logprobs=None if d.logprobs is None else self.logprobs,
            top_logprobs=None if d.top_logprobs is None else self.top_logprobs,
            ttft=d.ttft, stop_reason=d.stop_reason, chunks=self.chunks,
        )


def group_error(exc: Exception, group: str) -> Exception:
    """What a Ray error from a leader call means for the caller: the leader's own error (a bad request, a group
    failure, a failed or aborted request), or, for anything else (the actor died), a group failure."""
    from ray.exceptions import RayTaskError

    cause = getattr(exc, "cause", None) if isinstance(exc, RayTaskError) else None
    if isinstance(cause, (GroupUnhealthyError, RequestFailed, RequestAborted, ValueError)):
        return cause
    return GroupUnhealthyError(f"worker group {group!r} failed: {type(exc).__name__}")


def iter_outputs(leader, req: Submit, group: str, timeout_s: float | None = None) -> Iterator[RequestOutput]:
    """One request's outputs for a blocking caller (tests, the supervisor): its own short stream from the
    leader, one message per step; the request is aborted if the caller stops reading before its end.
    ``GroupUnhealthyError`` when the leader sends nothing for ``timeout_s`` (each wait, not the whole request)."""
    import ray
    from ray.exceptions import RayError

    req = Submit(req.prompt, req.params, req.tenant, req.request_id or f"req-{uuid.uuid4().hex}", req.pin_tokens,
                 req.pin_ttl_s)
    outputs, finished = Outputs(req, req.request_id), False
    try:
        gen = leader.generate.options(_generator_backpressure_num_objects=SUBSCRIPTION_BACKPRESSURE).remote(req)
        while not finished:  # the leader's stream ends with the request's finish: nothing is read after it
            ready, _ = ray.wait([gen], timeout=timeout_s)  # a leader that sends nothing fails the wait, too
            if not ready:
                raise GroupUnhealthyError(f"worker group {group!r} sent no output for {timeout_s:g} s")
            ref = next(gen, None)
            if ref is None:
                raise GroupUnhealthyError(f"worker group {group!r} ended the stream before the request finished")
            for d in ray.get(ref):
                finished = d.finished
                yield outputs.advance(d)
    except RayError as exc:
        raise group_error(exc, group) from exc
    finally:
        if not finished:  # also after a timeout; a failed group ignores it
            leader.abort.remote(req.request_id)


class GroupLink:
    """This event loop's subscription to one group leader: every request it streams shares it."""

    def __init__(self, group: str, leader) -> None:
        self.group, self.leader = group, leader
        self.id = f"sub-{uuid.uuid4().hex}"
        self._streams: dict[str, asyncio.Queue] = {}
        self._error: Exception | None = None
        self.messages = self.deltas = 0  # subscription messages and the deltas in them (batching, observed)
        self._ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._reader = asyncio.ensure_future(self._read())

    @property
    def closed(self) -> bool:
        return self._reader.done()

    async def _read(self) -> None:
        import ray

        error: Exception = GroupUnhealthyError(f"worker group {self.group!r} closed its subscription")
        gen = self.leader.subscribe.options(
            _generator_backpressure_num_objects=SUBSCRIPTION_BACKPRESSURE).remote(self.id)
        try:
            async for ref in gen:
                batch = await ref
                if not self._ready.done():
                    self._ready.set_result(None)
                if batch:
                    self.messages += 1
                    self.deltas += len(batch)
                for d in batch:
                    queue = self._streams.get(d.request_id)
                    if queue is not None:
                        queue.put_nowait(d)
        except asyncio.CancelledError:  # this loop is closing, this process is not: end the leader's side too
            ray.cancel(gen)
            raise
        except Exception as exc:  # a Ray error: the group failed, or its leader died
            error = group_error(exc, self.group)
        finally:  # also when cancelled (the loop is closing): no stream may wait on a reader that is gone
            self._error = error
            if not self._ready.done():
                self._ready.set_exception(error)
                self._ready.exception()  # read here, so a link nobody waited on logs nothing
            for queue in self._streams.values():
                queue.put_nowait(error)

    def _failed(self) -> Exception:
        """A fresh copy of the link's error for one request (one instance raised in many tasks would collect
        all their tracebacks)."""
        assert self._error is not None
        return type(self._error)(*self._error.args)

    async def stream(self, req: Submit, on_silence=None, silence_s: float = 60.0) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the group produces them. The request is aborted on the group if this stream
        is closed before its end. ``await on_silence()`` runs after every ``silence_s`` without a delta (it may
        raise to end the stream)."""
        from ray.exceptions import RayError

        rid = req.request_id or f"req-{uuid.uuid4().hex}"
        try:
            await asyncio.shield(self._ready)
        except Exception:
            raise self._failed() from None
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue  # before the submit: the first delta may come before the submit's reply
        finished = False
        try:
            if self._error is not None:
                raise self._failed()
            try:
                await self.leader.submit.remote(self.id, Submit(req.prompt, req.params, req.tenant, rid,
                                                                req.pin_tokens, req.pin_ttl_s))
            except RayError as exc:
                finished = True  # refused: there is nothing to abort
                raise group_error(exc, self.group) from None
            outputs = Outputs(req, rid)
            while not finished:
                item = await self._next(queue, on_silence, silence_s)
                if isinstance(item, Exception):
                    finished = True
                    raise type(item)(*item.args)
                finished = item.finished
                yield outputs.advance(item)
        finally:
            self._streams.pop(rid, None)
            if not finished and self._error is None:
                self.leader.abort.remote(rid)

    @staticmethod
    async def _next(queue: asyncio.Queue, on_silence, silence_s: float):
        while on_silence is not None and queue.empty():  # no timer (and no task) while deltas keep coming
            try:
                async with asyncio.timeout(silence_s):
                    return await queue.get()
            except TimeoutError:
                await on_silence()
        return await queue.get()
