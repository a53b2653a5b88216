"""The caller's side of the group protocol without Ray: cumulative outputs rebuilt from deltas, correct at every
step and in time linear in the request's length."""

from __future__ import annotations

import time

import pytest

from common.errors import RequestAborted, RequestFailed
from common.protocol import Delta, Outputs, Submit


def delta(i: int, finished: bool = False, logprobs: bool = True) -> Delta:
    return Delta(
        "r",
        [i],
        f"<{i}>",
        finished,
        "length" if finished else None,
        3,
        0,
        [-float(i)] if logprobs else None,
        [{i: -float(i)}] if logprobs else None,
    )


def test_each_output_is_cumulative_as_it_is_yielded_and_keeps_its_own_text():
    outputs = Outputs(Submit([1, 2, 3], tenant="acme"), "r")
    seen = []
    for i in range(5):
        out = outputs.advance(delta(i, finished=i == 4))
        assert out.token_ids == list(range(i + 1)) and out.new_token_ids == [i]
        assert out.logprobs == [-float(t) for t in range(i + 1)] and out.top_logprobs[-1] == {i: -float(i)}
        assert out.text == "".join(f"<{t}>" for t in range(i + 1)) and out.delta_text == f"<{i}>"
        assert (out.request_id, out.tenant, out.prompt_token_ids, out.num_cached_tokens) == ("r", "acme", [1, 2, 3], 3)
        seen.append(out)
    assert seen[-1].finished and seen[-1].finish_reason == "length"
    assert seen[1].text == "<0><1>"  # read after the stream went on: still its own step's text
    assert seen[2] != seen[3] and seen[4] == seen[4]


def test_outputs_without_logprobs_have_none_and_aborts_and_failures_raise():
    outputs = Outputs(Submit([1]), "r")
    out = outputs.advance(delta(0, logprobs=False))
    assert out.logprobs is None and out.top_logprobs is None
    with pytest.raises(RequestAborted):
        outputs.advance(Delta.abort("r"))
    with pytest.raises(RequestFailed, match="sampler broke"):
        outputs.advance(Delta("r", [], "", True, "error", 0, 0, error="sampler broke"))


def test_a_long_request_costs_linear_time():
    # Rebuilding the lists on every delta is quadratic: ~2 s for 40,000 tokens with logprobs, ~0.05 s linear.
    n = 40_000
    deltas = [delta(i, finished=i == n - 1) for i in range(n)]
    outputs = Outputs(Submit([1]), "r")
    started = time.process_time()
    for d in deltas:
        out = outputs.advance(d)
        assert len(out.token_ids) >= len(out.new_token_ids)  # what the gateway reads of every output
    took = time.process_time() - started
    assert out.token_ids == list(range(n)) and len(out.text) > n
    assert took < 0.5, f"{took:.2f} s of CPU for {n} deltas"


def test_a_submit_without_an_id_is_named_once_and_one_with_an_id_keeps_it():
    anonymous = Submit([1, 2], tenant="acme", pin_tokens=2)
    named = anonymous.named()
    assert named.request_id.startswith("req-") and named.named() is named
    assert (named.prompt, named.tenant, named.pin_tokens) == ([1, 2], "acme", 2) and anonymous.request_id is None
    assert Submit([1], request_id="mine").named().request_id == "mine"
    assert anonymous.named().request_id != named.request_id


def test_errors_from_a_leader_are_matched_by_class():
    from ray.exceptions import RayActorError, RayTaskError

    from common.errors import GroupUnhealthyError, group_error, remote_cause

    for cause in (
        ValueError("bad prompt"),
        RequestFailed("sampler"),
        RequestAborted("r"),
        GroupUnhealthyError("rank 1 died"),
    ):
        raised = RayTaskError("submit", "traceback", cause).as_instanceof_cause()
        assert remote_cause(raised) is cause and group_error(raised, "g0") is cause
    other = RayTaskError("submit", "traceback", KeyError("x")).as_instanceof_cause()
    failed = group_error(other, "g0")
    assert isinstance(failed, GroupUnhealthyError) and "'g0' failed" in str(failed)
    dead = group_error(RayActorError(), "g1")
    assert isinstance(dead, GroupUnhealthyError) and str(dead) == "worker group 'g1' failed: RayActorError"
    assert remote_cause(RayActorError()) is None
