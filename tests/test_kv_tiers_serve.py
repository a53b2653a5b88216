"""The disk tier through `kvgrid serve` (issue 15's restart target): stop the server, start it again with the same
KVGRID_SECRET and disk path, resend: the prompt is served from the disk tier (cached tokens, the same greedy
output), and another tenant sending the same text reuses nothing of it."""

from __future__ import annotations

import random

from harness import ACME_KEY, GLOBEX_KEY, TWO_TENANTS, an, chat, oa, serving

WORDS = "granite orchard silver canyon pepper violet harbor thunder maple lantern ribbon cobalt".split()


def test_a_prefix_computed_before_a_restart_is_a_hit_after_it(tmp_path_factory):
    disk = tmp_path_factory.mktemp("kv-disk")
    body = (
        "kv_cache_bytes: 67108864\n"
        f"kv_tiers: {{host_bytes: 33554432, disk_path: {disk}, disk_bytes: 134217728}}\n" + TWO_TENANTS
    )
    rng = random.Random(5)
    system = " ".join(rng.choice(WORDS) for _ in range(300))
    with serving(tmp_path_factory, body, [("acme", ACME_KEY), ("globex", GLOBEX_KEY)]) as server:
        first = chat(oa(server), "What comes first?", system=system, max_tokens=16)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        server.stop()  # the groups write their pools down to the disk tier
        assert any(disk.rglob("*")), "nothing was written to the disk tier"
        server.start()
        again = chat(oa(server), "What comes first?", system=system, max_tokens=16)
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens - 16  # every full block came back from disk
        assert again.choices[0].message.content == first.choices[0].message.content
        # The blocks on disk are acme's: globex (explicit, so it reports every reused token) reuses none of them.
        other = an(server).messages.create(
            model="demo",
            max_tokens=4,
            system=system,
            messages=[{"role": "user", "content": "What comes first?"}],
        )
        assert other.usage.cache_read_input_tokens == 0 and other.usage.cache_creation_input_tokens == 0
