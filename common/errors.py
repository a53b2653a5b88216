"""The errors that cross a component boundary, all in this module: raised on one side of a Ray call (a worker
group's leader, the group protocol) and read on the other (the gateway, the supervisor, ``WorkerGroup``).

Callers match them by class, never by name: an error raised in an actor method reaches its caller as a
``RayTaskError`` whose ``cause`` is the original instance (``remote_cause``), and ``group_error`` turns whatever a
call into a leader raised into the error the caller acts on."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class GroupUnhealthyError(RuntimeError):
    """The group lost a rank (or its leader failed, or stopped answering); its requests fail and it must be
    restarted."""


class RequestAborted(RuntimeError):
    """The request was aborted on the group (by another caller) before it finished."""


class RequestFailed(RuntimeError):
    """The engine failed this one request (sampling, detokenizing or stop checking it raised); the group and
    every other request keep running."""


def remote_cause(exc: BaseException) -> BaseException | None:
    """The error an actor method raised, from what its caller got (a ``RayTaskError``); None for anything else
    (the actor died, the call timed out, a Ray failure of its own)."""
    from ray.exceptions import RayTaskError

    return exc.cause if isinstance(exc, RayTaskError) else None


def group_error(exc: BaseException, group: str) -> Exception:
    """What a Ray error from a call into a group's leader means for the caller: the leader's own error (a bad
    request, a group failure, a failed or aborted request), or, for anything else (the actor died), a group
    failure."""
    cause = remote_cause(exc)
    if isinstance(cause, (GroupUnhealthyError, RequestFailed, RequestAborted, ValueError)):
        return cause
    return GroupUnhealthyError(f"worker group {group!r} failed: {type(exc).__name__}")


def field_path(loc: tuple[int | str, ...], whole: str, *, brackets: bool = False) -> str:
    """A pydantic error location as text: ``tenants.0.cache.mode``, or with ``brackets`` ``tenants[0].cache.mode``
    (a list index in brackets, as the serve config's errors show it); ``whole`` for the empty location."""
    if not brackets:
        return ".".join(str(p) for p in loc) or whole
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or whole


def validation_message(
    exc: ValidationError, whole: str, *, plain: bool = False, count: bool = False, brackets: bool = False
) -> str:
    """A pydantic ``ValidationError`` in one line, ``"{where}: {problem}"``, of its first error (the request
    bodies', the admin API's and the serve config's validation errors all read this way). ``whole``: the name of
    the location when the error is about the whole input; ``plain``: without pydantic's ``"Value error, "``
    prefix on a validator's own message; ``count``: with ``" (and N more)"`` when there are more errors;
    ``brackets``: list indices in brackets (``field_path``)."""
    first = exc.errors()[0]
    where = field_path(first["loc"], whole, brackets=brackets)
    problem = first["msg"].removeprefix("Value error, ") if plain else first["msg"]
    more = f" (and {exc.error_count() - 1} more)" if count and exc.error_count() > 1 else ""
    return f"{where}: {problem}{more}"


class Overloaded(RuntimeError):
    """Every group's prefill queue is at its limit (the router): the caller should retry later (HTTP 429)."""


class NoGroup(RuntimeError):
    """No worker group can take a request now (none started, all draining or failed): retry later (HTTP 503)."""
