"""No CPU-heavy work on a gateway's event loop: one tenant's huge answer or huge input never holds another
tenant's small requests. Tokenization, chat templates and the building and serialising of large answers run in the
gateway's bounded worker pool (``CpuPool``, at most some of its workers per tenant); a body that cannot fit the
context by its characters alone gets its 413 before it is tokenized; ``count_tokens`` counts against the tenant's
request rate like any request.

The latency checks measure the other tenant (``GET /v1/models``, a 1-token completion, every ~0.1 s) while the
hostile requests run, against its idle figures, and print both benchmark-style."""

from __future__ import annotations

import asyncio
import math
import secrets
import threading
import time

import httpx
import pytest

from common.config import ServeConfig
from harness import ACME_KEY, GLOBEX_KEY
from router.gateway.store import KeyRing

PROBE_EVERY_S = 0.1
MAX_PHASE_S = 240.0  # every measured phase ends by then, whatever happens


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def bound(idle: float) -> float:
    """What the other tenant's p99 may reach while a hostile request runs: twice its idle p99, or its idle p99 and
    half a second (a 2-core machine that also runs the groups has little headroom)."""
    return max(2 * idle, idle + 0.5)


def figures(name: str, samples: list[float]) -> str:
    ordered = sorted(samples)
    return (
        f"{name}: n={len(samples)} p50={ordered[len(ordered) // 2]:.3f}s p99={p99(samples):.3f}s max={ordered[-1]:.3f}s"
    )


# -- against the shared `kvgrid serve` ------------------------------------------------------------------------------


class Victim:
    """The other tenant (globex): ``GET /v1/models`` and a 1-token completion, alternately every ~0.1 s, in a thread
    of its own; latencies by kind."""

    def __init__(self, base: str) -> None:
        self.base, self.nonce = base, secrets.token_hex(4)
        self.samples: dict[str, list[float]] = {"models": [], "completion": []}
        self.errors: list[str] = []

    def run(self, stop: threading.Event, seconds: float) -> None:
        headers = {"Authorization": f"Bearer {GLOBEX_KEY}"}
        deadline = time.monotonic() + min(seconds, MAX_PHASE_S)
        i = 0
        with httpx.Client(base_url=f"{self.base}/globex/v1", headers=headers, timeout=120) as client:
            while not stop.is_set() and time.monotonic() < deadline:
                kind = "models" if i % 2 == 0 else "completion"
                started = time.monotonic()
                if kind == "models":
                    r = client.get("/models")
                else:
                    body = {"model": "demo", "prompt": f"Ping {self.nonce} {i}", "max_tokens": 1, "temperature": 0}
                    r = client.post("/completions", json=body)
                took = time.monotonic() - started
                if r.status_code != 200:
                    self.errors.append(f"{kind}: {r.status_code} {r.text[:200]}")
                self.samples[kind].append(took)
                i += 1
                time.sleep(max(0.0, PROBE_EVERY_S - took))

    def measure(self, seconds: float) -> dict[str, list[float]]:
        """The latencies of ``seconds`` of probing now (the idle figures)."""
        self.samples = {"models": [], "completion": []}
        self.run(threading.Event(), seconds)
        return self.samples

    def during(self, hostile) -> tuple[dict[str, list[float]], object]:
        """The latencies while ``hostile()`` runs (in this thread), and what it returned."""
        self.samples = {"models": [], "completion": []}
        stop = threading.Event()
        probe = threading.Thread(target=self.run, args=(stop, MAX_PHASE_S), daemon=True)
        probe.start()
        time.sleep(0.3)  # the probe is going before the hostile request starts
        try:
            result = hostile()
        finally:
            stop.set()
            probe.join(MAX_PHASE_S)
        return self.samples, result


def check(name: str, idle: dict[str, list[float]], busy: dict[str, list[float]], kinds: tuple[str, ...]) -> None:
    for kind in ("models", "completion"):
        print(f"[{name}] idle   " + figures(kind, idle[kind]))
        print(f"[{name}] during " + figures(kind, busy[kind]) + f"  (bound {bound(p99(idle[kind])):.3f}s)")
    for kind in kinds:
        assert busy[kind], f"{name}: no {kind} probe finished while the hostile request ran"
        assert p99(busy[kind]) <= bound(p99(idle[kind])), (name, kind, sorted(busy[kind])[-5:])


@pytest.mark.slow
def test_a_huge_answer_leaves_the_other_tenant_served(shared_server):
    """n choices with top-20 logprobs: a 10 MB answer whose building and JSON took seconds on the event loop."""
    victim = Victim(shared_server.base)
    victim.measure(1.0)  # warm: connections, the victim's prompt route
    idle = victim.measure(4.0)
    assert not victim.errors, victim.errors
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": f"Tell a long story {secrets.token_hex(4)}"}],
        "n": 64,
        "max_tokens": 100,
        "logprobs": True,
        "top_logprobs": 20,
        "temperature": 1.0,
        "ignore_eos": True,
    }

    def hostile() -> tuple[httpx.Response, float]:
        started = time.monotonic()
        r = httpx.post(
            f"{shared_server.base}/acme/v1/chat/completions",
            headers={"Authorization": f"Bearer {ACME_KEY}"},
            json=body,
            timeout=MAX_PHASE_S,
        )
        return r, time.monotonic() - started

    busy, (r, took) = victim.during(hostile)
    assert r.status_code == 200, r.text[:500]
    reply = r.json()
    print(f"[huge answer] {len(r.content) / 1e6:.1f} MB in {took:.1f} s")
    assert len(reply["choices"]) == 64
    assert all(len(c["logprobs"]["content"]) == 100 for c in reply["choices"])
    assert all(len(t["top_logprobs"]) == 20 for c in reply["choices"] for t in c["logprobs"]["content"])
    assert not victim.errors, victim.errors
    check("huge answer", idle, busy, ("models", "completion"))


@pytest.mark.slow
def test_huge_inputs_are_refused_at_once_and_leave_the_other_tenant_served(shared_server):
    """4 concurrent 4 MB count_tokens, then 2 Mi-character chats and completions: each 413 by its size, before it is
    tokenized (they took 1-13 s of the event loop each)."""
    victim = Victim(shared_server.base)
    victim.measure(1.0)
    idle = victim.measure(4.0)
    text = ("harbour ferry lantern " * (2**21 // 22 + 1))[: 2**21]
    big = ("tide gull rope anchor " * (4 * 2**20 // 22))[: 4 * 2**20 - 4096]
    acme = {"Authorization": f"Bearer {ACME_KEY}"}

    def hostile() -> list[tuple[str, int, float]]:
        results: list[tuple[str, int, float]] = []

        def send(name: str, path: str, body: dict) -> None:
            started = time.monotonic()
            r = httpx.post(f"{shared_server.base}/acme{path}", headers=acme, json=body, timeout=MAX_PHASE_S)
            results.append((name, r.status_code, time.monotonic() - started))

        count = _count_body(big)
        threads = [
            threading.Thread(target=send, args=("count_tokens", "/v1/messages/count_tokens", count)) for _ in range(4)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join(MAX_PHASE_S)
        chat = {"model": "demo", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
        send("chat", "/v1/chat/completions", chat)
        send("completion", "/v1/completions", {"model": "demo", "prompt": text, "max_tokens": 1})
        contents = {"contents": [{"parts": [{"text": text}]}], "ttl": "60s"}
        send("cached content", "/v1/cachedContents", contents)
        gemini = {"contents": [{"role": "user", "parts": [{"text": text}]}]}
        send("gemini countTokens", "/v1beta/models/demo:countTokens", gemini)
        return results

    busy, results = victim.during(hostile)
    for name, status, took in results:
        print(f"[huge inputs] {name}: {status} in {took:.2f} s")
    assert not victim.errors, victim.errors
    check("huge inputs", idle, busy, ("models", "completion"))
    assert [s for _, s, _ in results] == [413] * 8, results


# -- against an in-process gateway (no groups: counting tokens needs none) ----------------------------------------

HOSTILE_KEY, OTHER_KEY = "sk-hostile-fair-01", "sk-other-fair-0001"


def _gateway(demo_path, redis_client, limits: dict | None = None):
    from router.gateway.app import create_app
    from router.gateway.core import Gateway

    config = ServeConfig.model_validate(
        {
            "max_model_len": 1024,
            "tenants": [
                {"name": "hostile", "api_keys": [HOSTILE_KEY], "limits": limits or {}},
                {"name": "other", "api_keys": [OTHER_KEY]},
            ],
        }
    )
    gw = Gateway(config, KeyRing.from_config(config), demo_path, [None], f"unix://{redis_client.socket_file}")
    return gw, create_app(gw)


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=MAX_PHASE_S)


class LoopProbe:
    """The other tenant on the same event loop: ``GET /v1/models`` every ~0.1 s; each latency is counted from when
    the request was due, so a loop held while the probe waits delays its next request."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client, self.samples = client, []

    async def run(self, stop: asyncio.Event, seconds: float) -> None:
        deadline = time.monotonic() + min(seconds, MAX_PHASE_S)
        due = time.monotonic()
        while True:
            r = await self.client.get("/other/v1/models", headers={"x-api-key": OTHER_KEY})
            assert r.status_code == 200, r.text
            done = time.monotonic()
            self.samples.append(done - due)  # from when it was due: a loop held meanwhile delays it
            if stop.is_set() or done > deadline:  # (checked after a request: one due during a hold is sent)
                return
            due = max(due + PROBE_EVERY_S, done)
            await asyncio.sleep(due - done)

    async def measure(self, seconds: float) -> list[float]:
        self.samples = []
        await self.run(asyncio.Event(), seconds)
        return self.samples

    async def during(self, hostile):
        self.samples = []
        stop = asyncio.Event()
        probe = asyncio.ensure_future(self.run(stop, MAX_PHASE_S))
        await asyncio.sleep(0.3)
        try:
            return await hostile
        finally:
            stop.set()
            await probe


def _count_body(text: str) -> dict:
    half = len(text) // 2  # a text field holds at most 2 Mi characters
    blocks = [{"type": "text", "text": text[:half]}, {"type": "text", "text": text[half:]}]
    return {"model": "demo", "messages": [{"role": "user", "content": blocks}]}


@pytest.mark.slow  # four tokenizations of a million characters: about 10 s of CPU
def test_tokenizing_huge_inputs_runs_off_the_event_loop(demo_path, redis_client):
    """Four concurrent count_tokens of 1 MB each, of a model whose context would hold them (the character bound
    lifted): they are tokenized in the worker pool, one at a time for their tenant, while the loop keeps answering
    the other tenant."""
    gw, app = _gateway(demo_path, redis_client)
    # A long-context model: the bound lets a megabyte through to the tokenizer.
    gw.max_model_len = gw.admission.max_model_len = gw.prompts.max_model_len = 2**21
    text = ("harbour ferry lantern quay " * (2**20 // 27 + 1))[: 2**20]

    async def run() -> tuple[list[float], list[float], list[httpx.Response], float]:
        async with _client(app) as client:
            probe = LoopProbe(client)
            await probe.measure(0.5)
            idle = await probe.measure(3.0)
            started = time.monotonic()

            async def hostile() -> list[httpx.Response]:
                headers = {"x-api-key": HOSTILE_KEY}
                path, body = "/hostile/v1/messages/count_tokens", _count_body(text)
                return list(await asyncio.gather(*(client.post(path, headers=headers, json=body) for _ in range(4))))

            replies = await probe.during(hostile())
            took = time.monotonic() - started
            busy = probe.samples
        await gw.close()
        return idle, busy, replies, took

    idle, busy, replies, took = asyncio.run(asyncio.wait_for(run(), MAX_PHASE_S))
    print(f"[4 x 1 MB count_tokens] {took:.1f} s")
    print("[4 x 1 MB count_tokens] idle   " + figures("models", idle))
    print("[4 x 1 MB count_tokens] during " + figures("models", busy) + f"  (bound {bound(p99(idle)):.3f}s)")
    counts = {r.json()["input_tokens"] for r in replies if r.status_code == 200}
    assert [r.status_code for r in replies] == [200] * 4 and len(counts) == 1, [r.text[:200] for r in replies]
    assert counts.pop() > 200_000
    assert p99(busy) <= bound(p99(idle)), sorted(busy)[-5:]


def test_count_tokens_counts_against_the_request_rate(demo_path, redis_client):
    """count_tokens (Anthropic's and Gemini's) is a request like any other: past the tenant's requests_per_s it gets
    429 with Retry-After, and the other tenant is not limited."""
    gw, app = _gateway(demo_path, redis_client, {"requests_per_s": 1})
    anthropic = {"model": "demo", "messages": [{"role": "user", "content": "How many tokens?"}]}
    gemini = {"contents": [{"role": "user", "parts": [{"text": "How many tokens?"}]}]}
    paths = [("/v1/messages/count_tokens", anthropic), ("/v1beta/models/demo:countTokens", gemini)]

    async def run() -> dict[str, list[httpx.Response]]:
        out: dict[str, list[httpx.Response]] = {}
        async with _client(app) as client:
            for path, body in paths:
                while time.time() % 1 > 0.5:  # six requests inside one second's window
                    await asyncio.sleep(0.05)
                for tenant, key in (("hostile", HOSTILE_KEY), ("other", OTHER_KEY)):
                    sends = [client.post(f"/{tenant}{path}", headers={"x-api-key": key}, json=body) for _ in range(6)]
                    out[f"{tenant}{path}"] = list(await asyncio.gather(*sends))
                await asyncio.sleep(1.0)
        await gw.close()
        return out

    out = asyncio.run(asyncio.wait_for(run(), MAX_PHASE_S))
    for name, replies in out.items():
        statuses = sorted(r.status_code for r in replies)
        print(f"[rate] {name}: {statuses}")
        if name.startswith("hostile"):
            assert statuses == [200] + [429] * 5, name
            assert all(r.headers["retry-after"] == "1" for r in replies if r.status_code == 429)
        else:
            assert statuses == [200] * 6, name


def test_a_body_too_long_for_the_context_is_refused_before_it_is_tokenized(demo_path, redis_client, monkeypatch):
    """By its characters alone (every token of the model covers at most a few of them), every API's prompt that
    cannot fit the context, or the tenant's max_prompt_tokens, gets 413 without being tokenized."""
    import router.gateway.prompts as prompts

    encoded: list[int] = []
    real = prompts.encode_chat

    def counting(*args, **kw):
        encoded.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(prompts, "encode_chat", counting)
    gw, app = _gateway(demo_path, redis_client, {"max_prompt_tokens": 100})
    text = ("harbour ferry lantern " * (2**21 // 22 + 1))[: 2**21]
    short = "harbour ferry " * 60  # over hostile's 100 tokens, but not by its characters alone (100 x 17 of them)
    chat = {"model": "demo", "max_tokens": 1}
    requests = [
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": text}]}),
        ("/v1/completions", {**chat, "prompt": text}),
        ("/v1/messages", {**chat, "messages": [{"role": "user", "content": text}]}),
        ("/v1/messages/count_tokens", _count_body(text)),
        ("/v1beta/models/demo:countTokens", {"contents": [{"parts": [{"text": text}]}]}),
        ("/v1beta/models/demo:generateContent", {"contents": [{"parts": [{"text": text}]}]}),
        ("/v1/cachedContents", {"contents": [{"parts": [{"text": text}]}]}),
        ("/v1beta/cachedContents", {"model": "models/demo", "contents": [{"parts": [{"text": text}]}]}),
    ]

    async def run() -> list[tuple[str, str, httpx.Response, float]]:
        out = []
        async with _client(app) as client:
            for tenant, key in (("other", OTHER_KEY), ("hostile", HOSTILE_KEY)):
                for path, body in requests:
                    started = time.monotonic()
                    r = await client.post(f"/{tenant}{path}", headers={"x-api-key": key}, json=body)
                    out.append((tenant, path, r, time.monotonic() - started))
            out.append(("-", "encoded", httpx.Response(200, json=len(encoded)), 0.0))
            # Within the bound, the prompt is tokenized and refused by its tokens, as before.
            r = await client.post(
                "/hostile/v1/chat/completions",
                headers={"x-api-key": HOSTILE_KEY},
                json={**chat, "messages": [{"role": "user", "content": short}]},
            )
            out.append(("hostile", "short chat", r, 0.0))
        await gw.close()
        return out

    results = asyncio.run(asyncio.wait_for(run(), MAX_PHASE_S))
    for tenant, path, r, took in results[:-2]:
        print(f"[2 Mi characters] {tenant}{path}: {r.status_code} in {took:.3f} s")
        assert r.status_code == 413, (tenant, path, r.text[:300])
        assert "characters" in r.text, (tenant, path, r.text[:300])
    assert results[-2][2].json() == 0  # none of them reached the chat template and tokenizer
    r = results[-1][2]
    assert r.status_code == 413 and "100" in r.text and "tokens" in r.text, r.text
    assert encoded


def test_the_cpu_pool_keeps_a_worker_for_another_tenant():
    """A tenant with many jobs runs at most its share of them at once (one of two workers here), also after the
    requests waiting for them have gone: another tenant's job starts at once."""
    from router.gateway.prompts import CpuPool

    running: dict[str, int] = {"a": 0, "b": 0}
    most = {"a": 0, "b": 0}
    lock = threading.Lock()

    def job(tenant: str, seconds: float) -> float:
        with lock:
            running[tenant] += 1
            most[tenant] = max(most[tenant], running[tenant])
        time.sleep(seconds)  # (releases the GIL, like tokenizing)
        with lock:
            running[tenant] -= 1
        return time.monotonic()

    async def run() -> float:
        pool = CpuPool(2, 1)
        try:
            flood = [asyncio.ensure_future(pool.run("a", job, "a", 0.3)) for _ in range(4)]
            await asyncio.sleep(0.05)
            flood[0].cancel()  # its job runs on, and keeps a's share until it ends
            started = time.monotonic()
            await pool.run("b", job, "b", 0.0)
            waited = time.monotonic() - started
            await asyncio.gather(*flood[1:])
            return waited
        finally:
            pool.close()

    waited = asyncio.run(asyncio.wait_for(run(), 60))
    print(f"[cpu pool] the other tenant's job waited {waited * 1000:.1f} ms")
    assert most == {"a": 1, "b": 1}
    assert waited < 0.2
