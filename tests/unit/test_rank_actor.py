"""The leader's side of the group protocol (``RankActor`` rank 0) driven without Ray, on a scripted engine: what a
step that fails does to the requests it had finished, and that any failure of the step loop fails the group."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.errors import GroupUnhealthyError
from common.outputs import RequestOutput
from common.protocol import Submit
from worker.rank_actor import RankActor


def output(rid: str, tokens: list[int], new: list[int], finished: bool) -> RequestOutput:
    return RequestOutput(
        rid,
        "default",
        [1, 2],
        tokens,
        "x" * len(tokens),
        new,
        "x" * len(new),
        finished,
        "length" if finished else None,
        0,
    )


class ScriptedEngine:
    """Runs ``steps`` in order: each is a list of outputs to return, or an exception to raise."""

    def __init__(self, steps: list) -> None:
        self.steps = list(steps)
        self.requests: list[str] = []
        self.aborted: list[str] = []

    def add_request(self, req: Submit) -> str:
        assert req.request_id is not None
        self.requests.append(req.request_id)
        return req.request_id

    def abort(self, rid: str) -> bool:
        self.aborted.append(rid)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.steps)

    def step(self) -> list[RequestOutput]:
        item = self.steps.pop(0)
        if isinstance(item, Exception):
            raise item
        return item


def leader(engine) -> RankActor:
    actor = RankActor(0, 1)
    actor.engine = engine
    return actor


async def until_failed(actor: RankActor, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while actor.error is None:
        assert time.monotonic() < deadline, "the group never turned unhealthy"
        await asyncio.sleep(0.01)


def test_a_subscription_delivers_the_last_good_step_before_the_failure():
    engine = ScriptedEngine(
        [
            [output("done", [5], [5], True), output("long", [6], [6], False)],
            RuntimeError("peer rank gone"),
        ]
    )
    actor = leader(engine)

    async def scenario():
        sub = actor.subscribe("s")
        assert await sub.__anext__() == []
        await actor.submit("s", Submit([1, 2], request_id="done"))
        await actor.submit("s", Submit([1, 2], request_id="long"))
        await until_failed(actor)  # the step after the good one failed before the reader read
        batch = await sub.__anext__()
        assert [(d.request_id, d.finished) for d in batch] == [("done", True), ("long", False)]
        with pytest.raises(GroupUnhealthyError, match="peer rank gone"):
            await asyncio.wait_for(sub.__anext__(), 1.0)  # at once: no heartbeat wait once failed

    asyncio.run(scenario())


def test_a_request_stream_delivers_its_finish_from_the_last_good_step():
    engine = ScriptedEngine(
        [
            [output("r", [5], [5], False)],
            [output("r", [5, 6], [6], True)],
            RuntimeError("peer rank gone"),
        ]
    )
    actor = leader(engine)

    async def scenario():
        stream = actor.generate(Submit([1, 2], request_id="r"))
        first = await stream.__anext__()
        assert [d.new_token_ids for d in first] == [[5]]
        await until_failed(actor)
        last = await stream.__anext__()
        assert [(d.new_token_ids, d.finished) for d in last] == [([6], True)]

    asyncio.run(scenario())


class BadOutputs(ScriptedEngine):
    def step(self):
        super().step()
        return [object()]  # handling it (``Delta.of``) raises


class BadHasUnfinished(ScriptedEngine):
    def has_unfinished(self) -> bool:
        if self.aborted or len(self.steps) < 2:
            raise RuntimeError("scheduler state broken")
        return True


@pytest.mark.parametrize(
    "engine",
    [
        BadOutputs([[], []]),
        BadHasUnfinished([[output("r", [5], [5], False)], [], []]),
    ],
    ids=["handling outputs", "has_unfinished"],
)
def test_any_error_in_the_step_loop_fails_the_group_and_its_requests(engine):
    actor = leader(engine)

    async def scenario():
        sub = actor.subscribe("s")
        await sub.__anext__()
        await actor.submit("s", Submit([1, 2], request_id="r"))
        await until_failed(actor)
        assert "step loop failed: " in actor.health()
        with pytest.raises(GroupUnhealthyError):
            async with asyncio.timeout(1.0):
                async for _ in sub:
                    pass

    asyncio.run(scenario())


def test_a_cancelled_step_loop_fails_the_group():
    actor = leader(ScriptedEngine([[], [], []]))

    async def scenario():
        actor.engine.has_unfinished = lambda: False  # the loop waits for work
        sub = actor.subscribe("s")
        await sub.__anext__()
        await actor.submit("s", Submit([1, 2], request_id="r"))
        (loop_task,) = actor._background
        loop_task.cancel()
        await until_failed(actor)
        assert actor.health() == "rank 0: the step loop was cancelled"

    asyncio.run(scenario())


def test_an_abort_that_fails_unexpectedly_is_logged_and_the_others_still_abort(caplog):
    class FailingAbort(ScriptedEngine):
        def abort(self, rid):
            if rid == "a":
                raise RuntimeError("abort broke")
            return super().abort(rid)

    engine = FailingAbort([])
    actor = leader(engine)

    async def scenario():
        await actor._abort_all(["a", "b"])

    asyncio.run(scenario())
    assert engine.aborted == ["b"]
    assert "aborting request a of a closed subscription failed" in caplog.text and "abort broke" in caplog.text
