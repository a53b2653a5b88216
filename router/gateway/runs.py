"""A request's run as the API handlers consume it: an async generator of (output, tokens the router expected
cached), started early (``primed``) so its first error comes before any response, drained (``last``), or
stopped when the client disconnects (``watched``: a 499, and the request aborted on its group)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import TypeVar

from fastapi import Request

from common.outputs import RequestOutput
from router.gateway.errors import err

T = TypeVar("T")

# A request's outputs, each with the tokens the router expected cached.
Run = AsyncGenerator[tuple[RequestOutput, int], None]
Account = Callable[[RequestOutput, int], None]  # records a request's usage from its last output once it ended


def no_account(out: RequestOutput, predicted: int) -> None:
    """Internal requests (computing cached content) are recorded by their callers."""


async def primed(run: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    """Start ``run`` now (so its first error surfaces before a response is sent) and return an equivalent."""
    first = await run.__anext__()

    async def rest() -> AsyncGenerator[T, None]:
        try:
            yield first
            async for item in run:
                yield item
        finally:  # a stream cut short stops ``run`` now, not when the collector gets to it
            await run.aclose()

    return rest()


async def last(run: Run) -> tuple[RequestOutput, int]:
    final = None
    async for out in run:
        final = out
    assert final is not None
    return final


async def _client_gone(request: Request) -> None:
    """Returns when the client has disconnected (the body was read already: the next message is the
    disconnect)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # the connection state cannot be read: never cut a request on that
        await asyncio.Event().wait()


async def watched(request: Request, run: AsyncGenerator[T, None], api: str) -> AsyncGenerator[T, None]:
    """``run``'s items until the client disconnects; then ``run`` is stopped (its group request aborted) and a
    499 raised, whatever headers the client sent.

    The disconnect cancels the task waiting for ``run``'s next item, if one is (the task reading this
    generator, whichever it is at the time); a disconnect while the reader is elsewhere (writing the last item
    out) is raised when it asks for the next one. No task per item: a stream's tokens cost one await each."""
    gone = asyncio.ensure_future(_client_gone(request))
    waiting: asyncio.Task | None = None  # the task awaiting run's next item, while one is
    left = False

    def on_gone(f: asyncio.Future) -> None:
        nonlocal left
        if f.cancelled():
            return
        left = True
        if waiting is not None:
            waiting.cancel()

    gone.add_done_callback(on_gone)
    try:
        while True:
            if left:
                raise err(499, "the client closed the request", api)
            waiting = asyncio.current_task()
            try:
                item = await run.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                # Ours (the client left) unless the task was also cancelled by someone else: that one goes on.
                if not left or waiting is None or waiting.uncancel() > 0:
                    raise
                raise err(499, "the client closed the request", api) from None
            finally:
                waiting = None
            yield item
    finally:
        gone.remove_done_callback(on_gone)
        gone.cancel()
        await run.aclose()
