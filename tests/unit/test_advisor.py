"""The cache advisor (router/gateway/advisor.py), offline: on randomized workloads it finds a timestamp, a date or an
id planted at a random place of a long system prompt (>= 95 of 100 cases: where it is, the varying text, how many
more tokens would be cached), and gives no advice on 100 stable workloads; explicit tenants get breakpoints that
pay; ``kvgrid advise --file`` runs the same analysis on a JSONL of prompts."""

from __future__ import annotations

import json
import random
import uuid

import pytest

from common.config import PricesConfig
from common.model_config import load_tokenizer
from router.cli import main
from router.gateway.advisor import PromptView, advise, compare, kind_of, view_of_messages
from router.gateway.economics import Prices

BLOCK = 16
WORDS = (
    "the shop rents city bikes electric bikes and cargo bikes by the day helmets and locks are included a deposit "
    "is returned when the bike comes back undamaged guided tours leave on weekends from the harbour maps of the "
    "coastal routes are sold at the counter late returns are charged half a day extra flat tyres are repaired free"
).split()


@pytest.fixture(scope="module")
def tok(demo_path):
    return load_tokenizer(demo_path)


def _system(rng: random.Random, words: int = 900) -> str:
    sentences, out = [], []
    for _ in range(words):
        out.append(rng.choice(WORDS))
        if rng.random() < 0.08:
            sentences.append(" ".join(out).capitalize() + ".")
            out = []
    sentences.append(" ".join(out).capitalize() + ".")
    return " ".join(sentences)


def _value(kind: str, rng: random.Random, k: int) -> str:
    """The planted span of request ``k``: different in every request of a workload."""
    if kind == "timestamp":
        day, hour = f"2026-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}", rng.randrange(24)
        return f"{day}T{hour:02d}:{k:02d}:{rng.randrange(60):02d}Z"
    if kind == "date":
        return f"{rng.randrange(2020, 2030)}-{rng.randrange(1, 13):02d}-{1 + k:02d}"
    if kind == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128)))
    return f"req_{rng.getrandbits(40):x}"


def _question(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 14))) + "?"


def _workload(tok, rng: random.Random, kind: str | None, n: int = 5):
    """``n`` chat prompts with one long system prompt (the planted span, if ``kind``, at a random word of it) and a
    different question each; also where it was planted (character offset in the system prompt)."""
    system = _system(rng)
    cut = system.rfind(" ", 0, rng.randrange(len(system))) + 1
    label = rng.choice(["Current time: ", "Today is ", "Request ", "Session id ", ""])
    views, planted = [], []
    for k in range(n):
        text = system
        if kind is not None:
            value = _value(kind, rng, k)
            planted.append(value)
            text = system[:cut] + f"{label}{value}. " + system[cut:]
        messages = [{"role": "system", "content": text}, {"role": "user", "content": _question(rng)}]
        views.append(view_of_messages(tok, messages, at=60.0 * k))
    return views, cut + len(label), planted


def test_finds_a_planted_varying_span_in_95_of_100_random_workloads(tok):
    rng = random.Random(17)
    prices = Prices.from_config(PricesConfig(preset="anthropic"))
    found = 0
    for case in range(100):
        kind = ("timestamp", "date", "uuid", "id")[case % 4]
        views, at, planted = _workload(tok, rng, kind)
        advice = advise(views, BLOCK, prices)["advice"]
        hits = [
            a
            for a in advice
            if a["message"] == 0
            and a["char_offset"] == at
            and a["varying_text"]
            and a["varying_text"][-1] == planted[-1]
        ]
        if hits:
            a = hits[0]
            # Where it is in tokens, and what moving it would gain: the system prompt's rest, in whole blocks.
            # (The token before the span may differ too: a space merges with what follows it.)
            start = views[-1].tokens_before(views[-1].spans[0][0] + at)
            assert start - 1 <= a["token_offset"] <= start
            assert a["cached_tokens_now"] == a["token_offset"] // BLOCK * BLOCK
            assert a["extra_cached_tokens"] >= BLOCK and a["saving_per_request_usd"] > 0
            assert a["kind"] in (kind, "id", "timestamp", "date")
            found += 1
    assert found >= 95, f"found the planted span in {found} of 100 workloads"


def test_no_advice_on_100_stable_workloads(tok):
    rng = random.Random(23)
    advised = 0
    for case in range(100):
        views, _, _ = _workload(tok, rng, None)
        if case % 2:  # a multi-turn conversation: every prompt extends the one before
            messages = [{"role": "system", "content": _system(rng)}]
            views = []
            for k in range(5):
                messages += [{"role": "user", "content": _question(rng)}]
                views.append(view_of_messages(tok, messages, at=30.0 * k))
                messages += [{"role": "assistant", "content": _question(rng)}]
        advised += bool(advise(views, BLOCK)["advice"])
    assert advised == 0, f"advice on {advised} of 100 stable workloads"


def test_kinds_and_token_only_prompts():
    assert kind_of("2026-12-01T10:15:03Z") == "timestamp"
    assert kind_of("2026-12-01") == "date"
    assert kind_of(str(uuid.uuid4())) == "uuid"
    assert kind_of("1043") == "counter"
    assert kind_of("req_8f3a9c21") == "id"
    rng = random.Random(5)
    stable = [rng.randrange(1000) for _ in range(400)]
    views = [PromptView(token_ids=stable[:50] + [900 + k, 901 + k] + stable[50:] + [k]) for k in range(4)]
    advice = advise(views, BLOCK)["advice"]
    assert len(advice) == 1 and advice[0]["token_offset"] == 50 and advice[0]["extra_cached_tokens"] >= 350
    assert compare(views[0], PromptView(token_ids=views[0].token_ids + [1, 2])) is None  # an extension


def test_explicit_tenants_get_breakpoints_that_pay(tok):
    rng = random.Random(3)
    system = _system(rng)
    views = [
        view_of_messages(
            tok, [{"role": "system", "content": system}, {"role": "user", "content": _question(rng)}], at=k
        )
        for k in range(6)
    ]
    out = advise(views, BLOCK, Prices.from_config(PricesConfig(preset="anthropic")), explicit=True)
    assert out["advice"] == []
    bp = out["breakpoints"][0]
    system_tokens = views[0].tokens_before(views[0].spans[0][1])
    assert system_tokens - BLOCK < bp["token_offset"] <= system_tokens + BLOCK  # at the end of the system prompt
    assert bp["reads"] == 5 and bp["writes"] == 1 and bp["saving_over_sample_usd"] > 0
    # The same prompts an hour apart: every one would write, nothing pays.
    for k, v in enumerate(views):
        v.time = 3600.0 * k
    assert advise(views, BLOCK, explicit=True)["breakpoints"] == []


def test_kvgrid_advise_reads_a_jsonl_of_prompts(tmp_path, demo_path, capsys):
    rng = random.Random(11)
    system = _system(rng)
    path = tmp_path / "prompts.jsonl"
    with path.open("w") as f:
        for k in range(4):
            text = system[:200] + f"Today is 2026-11-{10 + k:02d}. " + system[200:]
            f.write(json.dumps({"messages": [{"role": "system", "content": text}, {"role": "user", "content": "Hi?"}]}))
            f.write("\n")
    assert main(["advise", "--file", str(path), "--model", str(demo_path), "--prices", "openai", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (a,) = report["advice"]
    assert a["kind"] == "date" and a["message"] == 0 and a["varying_text"][-1] == "2026-11-13"
    assert main(["advise", "--file", str(path), "--model", str(demo_path)]) == 0
    assert "date" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": 3}\n')
    assert main(["advise", "--file", str(bad), "--model", str(demo_path)]) == 2
    assert "line 1" in capsys.readouterr().err
