"""The Gemini API (v1beta) through the official ``google-genai`` SDK, on the shared `kvgrid serve`: cached content
objects created, read, listed, given a new lifetime and deleted, and generateContent (whole and streamed) and
countTokens with them; usage fields that show the group's reuse; tenant isolation; refusals that name the field."""

from __future__ import annotations

import datetime as dt
import random

import pytest
from google import genai
from google.genai import errors, types

from harness import ACME_KEY, GLOBEX_KEY, Server

WORDS = "alpha beta gamma delta river stone cloud maple orbit lantern copper meadow violet anchor".split()


def gemini(server: Server, tenant: str = "acme", key: str = ACME_KEY) -> genai.Client:
    return genai.Client(
        api_key=key,
        http_options=types.HttpOptions(base_url=f"{server.base}/{tenant}", api_version="v1beta", timeout=120_000),
    )


def _text(seed: int, n: int = 120) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _greedy(max_tokens: int = 8, **kw) -> types.GenerateContentConfig:
    return types.GenerateContentConfig(temperature=0.0, max_output_tokens=max_tokens, **kw)


def test_cached_content_lifecycle_and_generation(shared_server):
    client = gemini(shared_server)
    seed = random.randrange(2**31)
    cache = client.caches.create(
        model="demo",
        config=types.CreateCachedContentConfig(
            system_instruction=f"You answer questions about this catalogue. {_text(seed)}",
            contents=[types.Content(role="user", parts=[types.Part(text=_text(seed + 1, 80))])],
            display_name="catalogue",
            ttl="300s",
        ),
    )
    assert cache.name.startswith("cachedContents/") and cache.display_name == "catalogue"
    assert cache.model == "models/demo" and cache.usage_metadata.total_token_count > 64
    assert cache.create_time is not None and cache.update_time == cache.create_time
    left = (cache.expire_time - cache.create_time).total_seconds()
    assert 290 <= left <= 301

    got = client.caches.get(name=cache.name)
    assert got.name == cache.name and got.usage_metadata.total_token_count == cache.usage_metadata.total_token_count
    assert cache.name in [c.name for c in client.caches.list(config=types.ListCachedContentsConfig(page_size=1))]

    # A new lifetime moves the expiry and the update time; the object is re-pinned for it.
    updated = client.caches.update(name=cache.name, config=types.UpdateCachedContentConfig(ttl="1200s"))
    assert updated.expire_time - got.expire_time > dt.timedelta(seconds=850)
    assert updated.update_time > updated.create_time

    ask = [types.Content(role="user", parts=[types.Part(text="Which item comes first?")])]
    first = client.models.generate_content(model="demo", contents=ask, config=_greedy(cached_content=cache.name))
    u = first.usage_metadata
    total = cache.usage_metadata.total_token_count
    # The content was computed and pinned when it was created: the group reuses its whole blocks.
    assert total - 16 < u.cached_content_token_count <= total
    assert u.prompt_token_count > total and 1 <= u.candidates_token_count <= 8
    assert u.total_token_count == u.prompt_token_count + u.candidates_token_count
    assert first.candidates[0].finish_reason in (types.FinishReason.STOP, types.FinishReason.MAX_TOKENS)
    assert first.text and first.model_version == "demo"

    # Streamed, the same greedy request gives the same text, in several chunks, the last one with the finish.
    chunks = list(
        client.models.generate_content_stream(model="demo", contents=ask, config=_greedy(cached_content=cache.name))
    )
    assert "".join(c.text or "" for c in chunks) == first.text
    assert chunks[-1].candidates[0].finish_reason == first.candidates[0].finish_reason
    assert all(c.candidates[0].finish_reason is None for c in chunks[:-1])
    # ... and reuses at least as much: the content, and now the whole blocks of the first request's prompt too.
    assert u.cached_content_token_count <= chunks[-1].usage_metadata.cached_content_token_count < u.prompt_token_count

    # countTokens counts what generateContent bills as the prompt.
    counted = client.models.count_tokens(model="demo", contents=ask)
    plain = client.models.generate_content(model="demo", contents=ask, config=_greedy(max_tokens=1))
    assert counted.total_tokens == plain.usage_metadata.prompt_token_count

    client.caches.delete(name=cache.name)
    with pytest.raises(errors.ClientError) as gone:
        client.caches.get(name=cache.name)
    assert gone.value.code == 404 and gone.value.status == "NOT_FOUND"
    with pytest.raises(errors.ClientError) as gone:
        client.models.generate_content(model="demo", contents=ask, config=_greedy(cached_content=cache.name))
    assert gone.value.code == 404


def test_cached_contents_are_the_tenants_own(shared_server):
    acme = gemini(shared_server)
    cache = acme.caches.create(
        model="models/demo", config=types.CreateCachedContentConfig(system_instruction=_text(7), ttl="120s")
    )
    globex = gemini(shared_server, "globex", GLOBEX_KEY)
    try:
        with pytest.raises(errors.ClientError) as other:
            globex.caches.get(name=cache.name)
        assert other.value.code == 404
        ask = [types.Content(role="user", parts=[types.Part(text="hello")])]
        with pytest.raises(errors.ClientError) as other:
            globex.models.generate_content(model="demo", contents=ask, config=_greedy(cached_content=cache.name))
        assert other.value.code == 404
        assert cache.name not in [c.name for c in globex.caches.list()]
    finally:
        acme.caches.delete(name=cache.name)


def test_refusals_name_the_field(shared_server):
    client = gemini(shared_server)
    ask = [types.Content(role="user", parts=[types.Part(text="hi")])]
    with pytest.raises(errors.ClientError) as bad:
        client.models.generate_content(
            model="demo", contents=ask, config=_greedy(response_mime_type="application/json")
        )
    assert bad.value.code == 400 and "responseMimeType" in bad.value.message and bad.value.status == "INVALID_ARGUMENT"
    with pytest.raises(errors.ClientError) as bad:
        client.models.generate_content(model="demo", contents=ask, config=_greedy(candidate_count=2))
    assert bad.value.code == 400 and "candidateCount" in bad.value.message
    with pytest.raises(errors.ClientError) as bad:
        client.models.generate_content(model="other-model", contents=ask, config=_greedy())
    assert bad.value.code == 404
    with pytest.raises(errors.ClientError) as bad:
        client.caches.create(model="demo", config=types.CreateCachedContentConfig(system_instruction="x", ttl="soon"))
    assert bad.value.code == 400 and "ttl" in bad.value.message
    stranger = gemini(shared_server, "acme", "sk-wrong")  # kept: a client that is collected closes its connection
    with pytest.raises(errors.ClientError) as denied:
        stranger.models.generate_content(model="demo", contents=ask)
    assert denied.value.code == 401 and denied.value.status == "UNAUTHENTICATED"
