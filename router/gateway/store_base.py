"""The base of the gateways' Redis stores: the client (``connect``, ``with_password``), the errors a store raises,
and ``_Backed``, a store whose every call is bounded and turns a Redis failure into ``StoreUnavailable``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

log = logging.getLogger(__name__)

T = TypeVar("T")


class StoreUnavailable(Exception):
    """Redis failed or did not answer in time; the operation may be retried later."""


class LimitExceeded(Exception):
    """A tenant's limit refused the write; the message names the limit."""


def connect(url: str, timeout_s: float = 1.0) -> redis.asyncio.Redis:
    """An async client whose every connect, read and write gives up after ``timeout_s``. A dropped connection
    (Redis restarted) is retried once on a fresh one; a timeout is not retried (a paused Redis would only cost
    another timeout)."""
    return redis.asyncio.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
    )


def with_password(url: str, password: str | None) -> str:
    """``url`` with ``password`` added, unless it has one already (or there is none to add)."""
    if not password:
        return url
    parts = urlsplit(url)
    if parts.password is not None or "password=" in parts.query:
        return url
    if parts.scheme == "unix":  # no host part to carry it: redis-py reads it from the query
        return f"{url}{'&' if parts.query else '?'}password={quote(password, safe='')}"
    user, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


async def _bounded(deadline_s: float, op: Awaitable[T]) -> T:
    """``op``'s result; StoreUnavailable if Redis fails or ``deadline_s`` passes first."""
    try:
        async with asyncio.timeout(deadline_s):
            return await op
    except (redis.RedisError, OSError, TimeoutError) as exc:
        raise StoreUnavailable(f"redis unavailable: {str(exc) or type(exc).__name__}") from None


def _timeout_of(client: redis.asyncio.Redis) -> float:
    return client.connection_pool.connection_kwargs.get("socket_timeout") or 1.0


class _Backed:
    """Holds the client and bounds every operation by its socket timeout (a few round trips each)."""

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.r = client
        # One operation may take a connect and a read; past this the caller gets StoreUnavailable, whatever
        # redis-py is still waiting for.
        self.deadline_s = 2 * _timeout_of(client)

    async def _do(self, op: Awaitable[T]) -> T:
        return await _bounded(self.deadline_s, op)


# Applies one batch of usage counts unless this ledger's batch ``seq`` was applied already, so a batch whose
# reply was lost can be sent again without counting twice.


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))
