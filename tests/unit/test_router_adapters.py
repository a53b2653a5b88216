"""The router under LoRA adapters: a prompt's block keys descend from the tenant's and the adapter's root, so the
index never matches blocks computed under another adapter or the base model, and a group that ran an adapter
lately is preferred when no group holds the prompt."""

from __future__ import annotations

from common.events import BlockStored
from router.routing.router import Router

SECRET = b"router-adapter-secret"
PROMPT = list(range(64))  # 4 blocks of 16


def test_keys_differ_per_adapter_and_from_the_base_model():
    router = Router(["g0"], SECRET)
    base = router.keys_for("acme", PROMPT)
    a = router.keys_for("acme", PROMPT, "a" * 32)
    b = router.keys_for("acme", PROMPT, "b" * 32)
    assert len(base) == len(a) == len(b) == 4
    assert not (set(base) & set(a)) and not (set(a) & set(b)) and not (set(base) & set(b))
    assert router.keys_for("acme", PROMPT, "a" * 32) == a  # the same adapter: the same keys (a hit)
    assert not set(router.keys_for("globex", PROMPT, "a" * 32)) & set(a)  # another tenant: never


def test_blocks_stored_under_an_adapter_match_only_under_it():
    router = Router(["g0", "g1"], SECRET, prediction_ttl_s=0)
    router.apply_events([("g1", BlockStored(router.keys_for("acme", PROMPT, "a" * 32), None))])
    assert router.match(router.keys_for("acme", PROMPT, "a" * 32)) == {"g1": 4}
    assert router.match(router.keys_for("acme", PROMPT)) == {}
    assert router.match(router.keys_for("acme", PROMPT, "b" * 32)) == {}
    assert router.route("acme", PROMPT, adapter="a" * 32).group == "g1"


def test_a_cold_prompt_goes_where_its_adapter_ran_lately():
    router = Router(["g0", "g1"], SECRET, prediction_ttl_s=0)
    first = router.route("acme", PROMPT, "r1", adapter="a" * 32)
    router.on_prefill_done("r1")
    router.on_finish("r1")
    # Another cold prompt under the same adapter: no group holds it, the loads are equal again, and the group
    # that holds the adapter is charged no load of it.
    again = router.route("acme", [7] * 64, "r2", adapter="a" * 32)
    assert again.group == first.group
    router.on_prefill_done("r2")
    router.on_finish("r2")
    # Without the adapter, nothing ties the prompt to that group: the other one, which did less lately, wins.
    other = router.route("acme", [9] * 64, "r3")
    assert other.group != first.group


def test_a_removed_group_forgets_its_adapters():
    router = Router(["g0", "g1"], SECRET)
    router.route("acme", PROMPT, "r1", adapter="a" * 32)
    held = [g for g in ("g0", "g1") if router.adapters.holds(g, "a" * 32)]
    assert len(held) == 1
    router.remove_group(held[0])
    assert not router.adapters.holds(held[0], "a" * 32)
