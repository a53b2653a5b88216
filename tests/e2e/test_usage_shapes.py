"""Every vendor's usage shape, read through the official SDKs on the shared `kvgrid serve`: DeepSeek's
``prompt_cache_hit_tokens`` / ``prompt_cache_miss_tokens`` beside OpenAI's ``cached_tokens``, and Anthropic's
``cache_creation`` split of the written tokens by TTL; and the split's rule on its own (``Claim.split``)."""

from __future__ import annotations

import random

from harness import GLOBEX_KEY, an, chat, oa
from router.gateway.anthropic.serving import Claim
from router.gateway.economics import Prices, request_cost

WORDS = "north south river field stone amber quiet harbor lamp cedar frost ember willow".split()


def _text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def test_split_gives_each_written_token_the_ttl_of_the_next_breakpoint():
    claim = Claim(write=96, read=0, ttl_at={32: 3600.0, 96: 300.0}, fallback_ttl=300.0)
    split = claim.split(0, 96)
    assert (split.ephemeral_1h_input_tokens, split.ephemeral_5m_input_tokens) == (32, 64)
    # A read of the first 48 tokens leaves 48 written, all before the 5-minute breakpoint.
    split = claim.split(48, 48)
    assert (split.ephemeral_1h_input_tokens, split.ephemeral_5m_input_tokens) == (0, 48)
    # No breakpoint (a cached content's prefix): the content's TTL decides.
    assert Claim(0, 64, {}, 3600.0).split(0, 64).ephemeral_1h_input_tokens == 64
    assert Claim(0, 64, {}, 120.0).split(0, 64).ephemeral_5m_input_tokens == 64
    # A custom TTL over five minutes counts as the one-hour kind.
    assert Claim(16, 0, {16: 900.0}, 900.0).split(0, 16).ephemeral_1h_input_tokens == 16


def test_mixed_ttl_writes_are_billed_each_at_its_own_ttl():
    claim = Claim(write=96, read=0, ttl_at={32: 3600.0, 96: 300.0}, fallback_ttl=300.0)
    assert claim.segments(0, 96) == [(32, 3600.0), (64, 300.0)]
    assert claim.segments(40, 56) == [(56, 300.0)]
    prices = Prices(input=3, output=15, cache_write_5m=4, cache_write_1h=6, cache_read=1, storage=7)
    cost = request_cost(prices, prompt=100, read=0, write=96, output=5, segments=claim.segments(0, 96))
    storage_s = 32 * 3600 + 64 * 300
    by_hand = 4 * 3 + 32 * 6 + 64 * 4 + 5 * 15 + storage_s * 7 // 3600
    assert (cost.cache_write_1h_tokens, cost.cache_write_5m_tokens) == (32, 64)
    assert cost.storage_token_seconds == storage_s
    assert abs(cost.cost - by_hand) <= 1  # the storage price per token-hour, rounded to a pico-dollar
    # One TTL for all of it (the old way) would bill the 64 short tokens at the one-hour price.
    assert request_cost(prices, 100, 0, 96, 5, 3600.0).cost > cost.cost


def test_openai_usage_carries_deepseek_names(shared_server):
    client = oa(shared_server)
    system = _text(random.randrange(2**31), 150)
    chat(client, "first question", system=system, max_tokens=2)
    u = chat(client, "second question", system=system, max_tokens=2).usage
    cached = u.prompt_tokens_details.cached_tokens
    assert cached > 0
    assert u.prompt_cache_hit_tokens == cached
    assert u.prompt_cache_hit_tokens + u.prompt_cache_miss_tokens == u.prompt_tokens


def test_anthropic_cache_creation_is_split_by_ttl(shared_server):
    client = an(shared_server, "globex", GLOBEX_KEY)
    seed = random.randrange(2**31)
    system = [{"type": "text", "text": _text(seed, 120), "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    question = {"type": "text", "text": _text(seed + 1, 80), "cache_control": {"type": "ephemeral", "ttl": "5m"}}

    def ask():
        return client.messages.create(
            model="demo", max_tokens=2, system=system, messages=[{"role": "user", "content": [question]}]
        ).usage

    first = ask()
    c = first.cache_creation
    assert first.cache_creation_input_tokens > 0 and first.cache_read_input_tokens == 0
    assert c.ephemeral_1h_input_tokens + c.ephemeral_5m_input_tokens == first.cache_creation_input_tokens
    assert c.ephemeral_1h_input_tokens > 0 and c.ephemeral_5m_input_tokens > 0  # both breakpoints wrote
    again = ask()  # everything marked is read now: nothing written, of either kind
    assert again.cache_read_input_tokens >= first.cache_creation_input_tokens
    assert again.cache_creation_input_tokens == 0
    assert again.cache_creation.ephemeral_1h_input_tokens == again.cache_creation.ephemeral_5m_input_tokens == 0
