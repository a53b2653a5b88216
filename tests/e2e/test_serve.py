"""The whole service: `kvgrid serve` on 127.0.0.1 with an external Redis, driven by the official SDKs."""

from __future__ import annotations

import random
import time

import anthropic
import httpx
import openai
import pytest
import redis

from common.model_config import load_tokenizer
from harness import ACME_KEY, GLOBEX_KEY, SYSTEM, an, chat, oa
from router.gateway.store import read_usage
from worker.models.registry import resolve_model


@pytest.fixture()
def server(shared_server):
    # The server test_isolation and test_loadgen share too (harness.SHARED_BODY: acme, globex, initech); the restart
    # test (marked restarts_server) runs after all of them and gets it to itself.
    return shared_server


@pytest.fixture()
def redis_url(server):
    return server.redis_url


def test_openai_chat_reports_cached_tokens_and_streams_the_same_text(server):
    client = oa(server)
    first = chat(client, "How much is a city bike?")
    second = chat(client, "Do I need a helmet?")
    assert first.usage.prompt_tokens > 64
    assert second.usage.prompt_tokens_details.cached_tokens >= 48
    chunks = list(chat(client, "Do I need a helmet?", stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == second.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == second.usage.completion_tokens
    assert httpx.get(f"{server.base}/acme/metrics").status_code == 401
    metrics = httpx.get(f"{server.base}/acme/metrics", headers={"Authorization": f"Bearer {ACME_KEY}"}).text
    assert 'kvgrid_requests_total{model_name="demo",tenant="acme"}' in metrics  # labelled as vLLM's: model_name
    assert "kvgrid_group_" not in metrics and "globex" not in metrics  # only the tenant's own counters


def test_anthropic_cache_control_writes_then_reads_then_writes_after_the_ttl(server):
    client = an(server)
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "3s"}}]

    def ask(q: str):
        return client.messages.create(
            model="demo",
            max_tokens=8,
            system=system,
            messages=[{"role": "user", "content": q}],
            extra_body={"temperature": 0},
        )

    first = ask("When do you open?")
    assert first.usage.cache_creation_input_tokens > 0 and first.usage.cache_read_input_tokens == 0
    second = ask("When do you close?")
    assert second.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens
    assert second.usage.cache_creation_input_tokens == 0
    with client.messages.stream(
        model="demo",
        max_tokens=8,
        system=system,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "When do you close?"}],
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == second.content[0].text and final.usage.output_tokens == second.usage.output_tokens
    time.sleep(3.5)
    third = ask("When do you open?")
    assert third.usage.cache_creation_input_tokens > 0
    u = third.usage
    assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens == first.usage.input_tokens + (
        first.usage.cache_creation_input_tokens + first.usage.cache_read_input_tokens
    )
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(
            model="demo",
            max_tokens=2,
            messages=[{"role": "user", "content": "hi"}],
            system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "a while"}}],
        )


def test_anthropic_second_breakpoint_reads_the_shared_first_one(server):
    client = an(server)
    system = [
        {
            "type": "text",
            "text": "Second-breakpoint check. " + SYSTEM,
            "cache_control": {"type": "ephemeral", "ttl": "1h"},
        }
    ]

    def ask(q: str):
        return client.messages.create(
            model="demo",
            max_tokens=4,
            system=system,
            extra_body={"temperature": 0},
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": q * 3, "cache_control": {"type": "ephemeral", "ttl": "5m"}}],
                }
            ],
        )

    first = ask("Where is the shop exactly? ")
    second = ask("What does a cargo bike cost? ")
    assert first.usage.cache_read_input_tokens == 0 and first.usage.cache_creation_input_tokens > 0
    # The system prompt's entry lives: read; only the new turn is written.
    assert second.usage.cache_read_input_tokens >= 96
    assert 0 < second.usage.cache_creation_input_tokens < first.usage.cache_creation_input_tokens


def test_cached_content_create_use_patch_delete(server):
    headers = {"Authorization": f"Bearer {ACME_KEY}"}
    doc = "The harbour ferry leaves every hour from pier four. " * 6
    r = httpx.post(
        f"{server.base}/acme/v1/cachedContents",
        headers=headers,
        timeout=120,
        json={"model": "models/demo", "contents": [{"role": "user", "parts": [{"text": doc}]}], "ttl": "600s"},
    )
    assert r.status_code == 200, r.text
    cc = r.json()
    cid = cc["name"].removeprefix("cachedContents/")
    tokens = cc["usageMetadata"]["totalTokenCount"]
    used = oa(server).chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "When does the ferry leave?"}],
        max_tokens=4,
        temperature=0,
        extra_body={"cached_content": cc["name"]},
    )
    assert used.usage.prompt_tokens_details.cached_tokens >= tokens // 16 * 16 > 0
    patched = httpx.patch(
        f"{server.base}/acme/v1/cachedContents/{cid}", headers=headers, json={"ttl": "30s"}, timeout=120
    )
    assert patched.status_code == 200 and patched.json()["expireTime"] < cc["expireTime"]
    assert httpx.get(f"{server.base}/acme/v1/cachedContents/{cid}", headers=headers).status_code == 200
    listed = httpx.get(f"{server.base}/acme/v1/cachedContents", headers=headers).json()["cachedContents"]
    assert cc["name"] in [c["name"] for c in listed]
    assert httpx.delete(f"{server.base}/acme/v1/cachedContents/{cid}", headers=headers).status_code == 200
    with pytest.raises(openai.NotFoundError):
        oa(server).chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            extra_body={"cached_content": cc["name"]},
        )


def test_tenants_are_separate(server):
    fresh = "A prompt only acme has sent so far. " + SYSTEM
    chat(oa(server), "What does the deposit cost?", fresh)
    assert chat(oa(server), "What does the deposit cost?", fresh).usage.prompt_tokens_details.cached_tokens > 0
    other = oa(server, "globex", GLOBEX_KEY)
    assert chat(other, "What does the deposit cost?", fresh).usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.AuthenticationError):
        chat(oa(server, "globex", ACME_KEY), "hello")
    with pytest.raises(anthropic.AuthenticationError):
        an(server, "globex", ACME_KEY).messages.create(
            model="demo", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    acme = {"Authorization": f"Bearer {ACME_KEY}"}
    globex = {"Authorization": f"Bearer {GLOBEX_KEY}"}
    r = httpx.post(
        f"{server.base}/acme/v1/cachedContents",
        headers=acme,
        timeout=120,
        json={"contents": [{"parts": [{"text": "acme's private notes " * 10}]}], "ttl": "600s"},
    )
    cid = r.json()["name"].removeprefix("cachedContents/")
    assert httpx.get(f"{server.base}/globex/v1/cachedContents/{cid}", headers=globex).status_code == 404
    assert httpx.delete(f"{server.base}/globex/v1/cachedContents/{cid}", headers=globex).status_code == 404
    with pytest.raises(openai.NotFoundError):
        other.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"cached_content": f"cachedContents/{cid}"},
        )
    assert httpx.get(f"{server.base}/acme/v1/cachedContents/{cid}", headers=acme).status_code == 200


def test_bad_requests_get_their_status_and_the_server_keeps_serving(server):
    client = oa(server)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=[], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.APIStatusError) as too_long:
        client.completions.create(model="demo", prompt=[5] * 2000, max_tokens=2)
    assert too_long.value.status_code == 413
    vocab = len(load_tokenizer(str(resolve_model("demo"))))  # the model the server runs (TEST_DEFAULTS)
    for ids in ([5, vocab], [vocab + 10**6, 5]):  # past the vocabulary, anywhere in the prompt
        with pytest.raises(openai.BadRequestError, match="token id outside the vocabulary"):
            client.completions.create(model="demo", prompt=ids, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="greater than or equal to 0"):  # the schema's own check
        client.completions.create(model="demo", prompt=[5, -1], max_tokens=1)
    assert client.completions.create(model="demo", prompt=[0, vocab - 1], max_tokens=1).usage.prompt_tokens == 2
    big = httpx.post(
        f"{server.base}/acme/v1/chat/completions",
        headers={"Authorization": f"Bearer {ACME_KEY}"},
        content=b"x" * (5 * 2**20),
        timeout=60,
    )
    assert big.status_code == 413
    with pytest.raises(anthropic.BadRequestError):
        an(server).messages.create(model="demo", max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.NotFoundError):
        an(server).messages.create(model="claude-x", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert chat(client, "Still there?").choices[0].finish_reason in ("length", "stop")


def test_ignore_eos_generates_max_tokens_where_the_model_would_stop(server):
    client = oa(server)

    def complete(seed: int, **extra):
        return client.completions.create(
            model="demo",
            prompt=[5, 6, 7, 8, 9, 10, 11, 12],
            max_tokens=128,
            temperature=1.0,
            seed=seed,
            extra_body=extra,
        )

    stopped = next(((s, out) for s in range(16) if (out := complete(s)).choices[0].finish_reason == "stop"), None)
    assert stopped is not None, "no seed made the demo model stop early: the test needs one"
    seed, early = stopped
    assert early.usage.completion_tokens < 128
    full = complete(seed, ignore_eos=True)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 128
    assert full.choices[0].text.startswith(early.choices[0].text)
    with pytest.raises(openai.BadRequestError):
        complete(seed, ignore_eos="yes")


@pytest.mark.restarts_server
def test_serve_prints_each_phase_of_its_start_in_order_and_no_secret(server):
    """kvgrid serve's output: one line per step as it is done (port, Redis, model, Ray, each group with its node, the
    routers, the gateways), then the banner and ``ready``; never a key."""
    import re

    from harness import ADMIN_KEY, SECRET, SHARED_INITECH_KEY, SHARED_UMBRELLA_KEY

    text = server.log_text()
    port = server.port
    phases = [
        rf"port 127\.0\.0\.1:{port}: free",
        rf"redis: {re.escape(server.redis_url)} answers",
        r"model: demo -> \S+( \(built on first use\))?",
        r"ray: started locally \(\d+ CPUs\)",
        r"group 1/2 ready on node \S+",  # the node's address (or id)
        r"group 2/2 ready on node \S+",
        r"router: 1 replica\(s\) ready",
        rf"gateway: 1 replica\(s\) ready on 127\.0\.0\.1:{port}",
        r"kvgrid is serving demo as model 'demo' with 2 worker group\(s\) of tp=1",
        r"  tenant acme: OpenAI base_url .*",
        r"ready",
    ]
    lines = text.splitlines()
    at = 0
    for phase in phases:  # each after the one before, in the first start's output
        at = next((i for i in range(at, len(lines)) if re.fullmatch(phase, lines[i])), None)
        assert at is not None, f"no line {phase!r} in order in:\n{text[-4000:]}"
        at += 1
    for secret in (ACME_KEY, GLOBEX_KEY, SHARED_INITECH_KEY, SHARED_UMBRELLA_KEY, ADMIN_KEY, SECRET):
        assert secret not in text


def test_a_restart_keeps_usage_cached_contents_and_the_kv_blocks_on_disk(server, redis_url):
    """Stop the server and start it again with the same Redis, KVGRID_SECRET and disk tier: the usage and cached
    contents in Redis are kept, and a prompt computed before the restart is read from the disk tier after it
    (a restart's target): cached tokens, the same greedy output, none of it for another tenant."""
    acme = {"Authorization": f"Bearer {ACME_KEY}"}
    r = httpx.post(
        f"{server.base}/acme/v1/cachedContents",
        headers=acme,
        timeout=120,
        json={"contents": [{"parts": [{"text": "kept across restarts " * 8}]}], "ttl": "600s"},
    )
    cid = r.json()["name"].removeprefix("cachedContents/")
    rng = random.Random(5)
    system = " ".join(rng.choice(TIER_WORDS) for _ in range(300))  # text no other test sends
    first = chat(oa(server), "What comes first?", system=system, max_tokens=16)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    before = _written_usage(redis_url)
    assert before["requests"] > 0 and before["prompt_tokens"] > 0
    disk = server.config.parent / "kv"  # harness.SHARED_BODY's disk_path
    server.stop()  # the groups write their pools down to the disk tier
    assert any(disk.rglob("*")), "nothing was written to the disk tier"
    # Ray's noise of a start and a stop: the supervisor's arguments "in the object store", a failed
    # graceful_shutdown task of Serve's controller (router/control/serve.py: both are avoided).
    text = server.log_text()
    assert "constructor arguments" not in text and "graceful_shutdown" not in text, text
    server.start()
    after = _written_usage(redis_url)
    assert after == before
    assert httpx.get(f"{server.base}/acme/v1/cachedContents/{cid}", headers=acme).status_code == 200
    again = chat(oa(server), "What comes first?", system=system, max_tokens=16)
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16  # every full block
    assert again.choices[0].message.content == first.choices[0].message.content
    assert _written_usage(redis_url)["requests"] == before["requests"] + 1
    # The blocks on disk are acme's: globex (explicit, so it reports every reused token) reuses none of them.
    other = an(server).messages.create(
        model="demo", max_tokens=4, system=system, messages=[{"role": "user", "content": "What comes first?"}]
    )
    assert other.usage.cache_read_input_tokens == 0 and other.usage.cache_creation_input_tokens == 0


TIER_WORDS = "granite orchard silver canyon pepper violet harbor thunder maple lantern ribbon cobalt".split()


def _written_usage(redis_url: str) -> dict[str, int]:
    """acme's usage in Redis once the gateway's ledger has written all of it (it flushes every 0.2 s)."""
    client = redis.Redis.from_url(redis_url)
    last, deadline = read_usage(client, "acme"), time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = read_usage(client, "acme")
        if now == last:
            return now
        last = now
    raise AssertionError("acme's usage in Redis kept changing")
