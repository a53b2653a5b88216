"""The messages that cross the boundary between a worker group's leader (rank 0) and its callers.

A request is sent with one ``submit`` (a ``Submit``). Its outputs come back as ``Delta``s: only what changed in
a step (new token ids, new text, new logprobs, the finish), never the prompt or the tokens so far. ``Outputs``
rebuilds from them the cumulative ``RequestOutput`` the caller reads (incrementally, never copying what came
before). The caller's side of the boundary, the subscription that carries the deltas and the client every call into
a leader goes through, is ``worker/group_client.py``; the counters a leader reports are ``common/stats.py``; the
errors that cross this boundary are in ``common.errors``.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from common.errors import RequestAborted, RequestFailed
from common.lora import AdapterRef
from common.outputs import RequestOutput, Timings
from common.sampling import SamplingParams

# The actor handles that cross components, named once. A handle's methods are the actor class's: a group's
# ranks are ``worker.rank_actor.RankActor`` (rank 0 is the leader), a router replica is
# ``router.routing.service.RouterService``, the supervisor is ``router.control.supervisor.Supervisor``.
# They are ray.actor.ActorHandle objects, typed Any: ray types a handle's method attributes as Never, so mypy
# would take the code after every actor call for unreachable and check none of it.
RankHandle: TypeAlias = Any
RouterHandle: TypeAlias = Any
SupervisorHandle: TypeAlias = Any


@dataclass(frozen=True)
class Submit:
    """One request for a group's leader (``RankActor.submit`` / ``generate``): the prompt's token ids, how to
    sample, whose it is, and how much of its prompt to pin for how long (explicit cache entries)."""

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    tenant: str = "default"
    request_id: str | None = None  # None: named by whoever sends it (a fresh ``req-...`` id)
    pin_tokens: int = 0
    pin_ttl_s: float = 300.0
    n: int = 1  # choices of the prompt (computed once); each of their deltas carries its ``index``
    adapter: AdapterRef | None = None  # the LoRA adapter to run under (None: the base model)

    def named(self) -> Submit:
        """This request with a request id: its own, else a fresh one."""
        return self if self.request_id is not None else dataclasses.replace(self, request_id=f"req-{uuid.uuid4().hex}")


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
    index: int = 0  # which choice (n > 1): a request has ended once each of its ``n`` choices finished
    timings: Timings | None = None  # the final delta's: where the request's time in the group went

    @classmethod
    def of(cls, out: RequestOutput) -> Delta:
        n_old = len(out.token_ids) - len(out.new_token_ids)
        return cls(
            out.request_id,
            out.new_token_ids,
            out.delta_text,
            out.finished,
            out.finish_reason,
            out.num_cached_tokens,
            out.num_pinned_tokens,
            None if out.logprobs is None else out.logprobs[n_old:],
            None if out.top_logprobs is None else out.top_logprobs[n_old:],
            out.ttft,
            out.stop_reason,
            out.error,
            index=out.index,
            timings=out.timings,
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
            self._text = "".join(self._chunks[: self._n])
        return self._text

    @text.setter
    def text(self, value: str | None) -> None:
        self._text = value


class _Choice:
    """One choice's cumulative lists, extended in place."""

    __slots__ = ("token_ids", "chunks", "logprobs", "top_logprobs")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.chunks: list[str] = []
        self.logprobs: list[float] | None = None
        self.top_logprobs: list[dict[int, float]] | None = None


class Outputs:
    """One request's cumulative outputs (of each of its ``n`` choices), built delta by delta in time linear in
    their length. Every output of a choice shares its ``token_ids`` / ``logprobs`` / ``top_logprobs`` lists,
    extended in place: each holds the values of the latest step when read as it is yielded (copy one to keep a
    step's values); ``text`` is the output's own (joined when read). ``done``: every choice has finished."""

    def __init__(self, req: Submit, request_id: str) -> None:
        self.request_id, self.tenant, self.prompt = request_id, req.tenant, req.prompt
        self.choices: dict[int, _Choice] = {}
        self.left = req.n  # choices not finished yet

    @property
    def done(self) -> bool:
        return self.left <= 0

    def advance(self, d: Delta) -> RequestOutput:
        """The cumulative output of ``d``'s choice after delta ``d``; raises ``RequestAborted`` or
        ``RequestFailed`` for those ends."""
        if d.aborted:
            raise RequestAborted(f"request {d.request_id} was aborted")
        if d.error is not None:
            raise RequestFailed(f"request {d.request_id} failed: {d.error}")
        c = self.choices.get(d.index)
        if c is None:
            c = self.choices[d.index] = _Choice()
        c.token_ids.extend(d.new_token_ids)
        if d.delta_text:
            c.chunks.append(d.delta_text)
        if d.logprobs is not None:
            if c.logprobs is None:
                c.logprobs = []
            c.logprobs.extend(d.logprobs)
        if d.top_logprobs is not None:
            if c.top_logprobs is None:
                c.top_logprobs = []
            c.top_logprobs.extend(d.top_logprobs)
        if d.finished:
            self.left -= 1
        return _StreamedOutput(
            request_id=self.request_id,
            tenant=self.tenant,
            prompt_token_ids=self.prompt,
            token_ids=c.token_ids,
            text=None,
            new_token_ids=d.new_token_ids,
            delta_text=d.delta_text,
            finished=d.finished,
            finish_reason=d.finish_reason,
            num_cached_tokens=d.num_cached_tokens,
            num_pinned_tokens=d.num_pinned_tokens,
            logprobs=None if d.logprobs is None else c.logprobs,
            top_logprobs=None if d.top_logprobs is None else c.top_logprobs,
            ttft=d.ttft,
            stop_reason=d.stop_reason,
            index=d.index,
            timings=d.timings,
            chunks=c.chunks,
        )
