"""Anthropic's count_tokens: exactly the input tokens the messages endpoint counts for the same body (system,
tools and messages, through the same chat encoding), without running it. And what the engine does not honour
is refused by name (400), never silently ignored."""

from __future__ import annotations

import secrets

import httpx

from harness import ACME_KEY, GLOBEX_KEY, an


def test_count_tokens_equals_what_messages_counts(shared_server):
    client = an(shared_server)
    nonce = secrets.token_hex(6)
    bodies = [
        dict(messages=[{"role": "user", "content": f"{nonce} how many tokens is this?"}]),
        dict(
            system=[{"type": "text", "text": f"{nonce} You are a counting assistant."}],
            messages=[
                {"role": "user", "content": "first"},
                {"role": "assistant", "content": "second"},
                {"role": "user", "content": [{"type": "text", "text": "third"}, {"type": "text", "text": " part"}]},
            ],
        ),
        dict(
            system=f"{nonce} with tools",
            tools=[
                {
                    "name": "get_weather",
                    "description": "The weather of a city",
                    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
                }
            ],
            messages=[{"role": "user", "content": "Weather in Paris?"}],
        ),
    ]
    counts = []
    for body in bodies:
        counted = client.messages.count_tokens(model="demo", **body)
        reply = client.messages.create(model="demo", max_tokens=1, **body)
        usage = reply.usage
        total = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
        assert counted.input_tokens == total
        counts.append(counted.input_tokens)
    assert counts[2] > counts[0]  # the tools are counted
    r = httpx.post(
        f"{shared_server.base}/globex/v1/messages/count_tokens",
        headers={"x-api-key": GLOBEX_KEY},
        json={"model": "demo", "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages.0.content.0")
    r = httpx.post(
        f"{shared_server.base}/globex/v1/messages/count_tokens",
        headers={"x-api-key": "sk-wrong-key-0000"},
        json={"model": "demo", "messages": [{"role": "user", "content": "x"}]},
        timeout=60,
    )
    assert r.status_code == 401


def test_what_the_engine_does_not_honour_is_refused_by_name(shared_server):
    """Fields the engine would otherwise silently ignore answer 400 naming the field."""
    base = f"{shared_server.base}/acme/v1"
    headers = {"Authorization": f"Bearer {ACME_KEY}"}
    chat = {"model": "demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    text = {"model": "demo", "prompt": "x", "max_tokens": 1}
    refused = [
        ("chat/completions", {**chat, "frequency_penalty": 0.5}, "frequency_penalty"),
        ("chat/completions", {**chat, "presence_penalty": -1}, "presence_penalty"),
        ("chat/completions", {**chat, "logit_bias": {"12": 5}}, "logit_bias"),
        ("chat/completions", {**chat, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ("chat/completions", {**chat, "modalities": ["text", "audio"]}, "modalities"),
        (
            "chat/completions",
            {**chat, "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages.0",
        ),
        ("chat/completions", {**chat, "reasoning_effort": "high"}, "reasoning_effort"),
        ("chat/completions", {**chat, "web_search_options": {}}, "web_search_options"),
        ("completions", {**text, "echo": True}, "echo"),
        ("completions", {**text, "suffix": "tail"}, "suffix"),
        ("completions", {**text, "best_of": 3}, "best_of"),
    ]
    for path, body, field in refused:
        r = httpx.post(f"{base}/{path}", headers=headers, json=body, timeout=60)
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["message"].startswith(field), (field, r.text)
    anthropic = {"model": "demo", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    thinking = {"type": "enabled", "budget_tokens": 1024}
    for path in ("messages", "messages/count_tokens"):
        r = httpx.post(
            f"{shared_server.base}/globex/v1/{path}",
            headers={"x-api-key": GLOBEX_KEY},
            json={**anthropic, "thinking": thinking},
            timeout=60,
        )
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("thinking"), r.text
    # Their neutral values are accepted.
    for path, body in [
        ("chat/completions", {**chat, "frequency_penalty": 0, "logit_bias": {}, "modalities": ["text"]}),
        ("completions", {**text, "best_of": 1, "echo": False}),
    ]:
        assert httpx.post(f"{base}/{path}", headers=headers, json=body, timeout=60).status_code == 200
    r = httpx.post(
        f"{shared_server.base}/globex/v1/messages",
        headers={"x-api-key": GLOBEX_KEY},
        json={**anthropic, "thinking": {"type": "disabled"}},
        timeout=60,
    )
    assert r.status_code == 200, r.text
