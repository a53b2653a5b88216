"""n > 1: one prefill, then n choices that share the prompt's blocks by reference count (the last partial block
copied on write), each exactly what a request of its own would compute; the prompt counted once."""

from __future__ import annotations

import secrets

import httpx
import pytest
import torch

from common.sampling import SamplingParams
from harness import ADMIN_KEY, oa
from worker.engine import Engine, EngineConfig

TOL = 1e-4


def engine(demo_path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(demo_path), device="cpu", num_blocks=kw.pop("num_blocks", 256), **kw))


def run(e: Engine, prompt: list[int], params: SamplingParams, n: int) -> list:
    """Every choice's final output, by index, and check they all carry the request's id."""
    rid = e.add_prompt(prompt, params, n=n)
    final = {}
    while e.has_unfinished():
        for out in e.step():
            assert out.request_id == rid
            if out.finished:
                assert out.index not in final
                final[out.index] = out
    assert sorted(final) == list(range(n))
    return [final[i] for i in range(n)]


@pytest.mark.parametrize("prompt_len", [37, 48])  # a partial last block (copied on write), and none
def test_n4_computes_the_prompt_once_and_shares_its_blocks(demo_path, prompt_len):
    e = engine(demo_path)
    prompt = list(range(200, 200 + prompt_len))
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1, ignore_eos=True)
    before = e.stats().computed_tokens
    rid = e.add_prompt(prompt, params, n=4)
    outs = e.step()  # the prefill: the prompt once, then four first tokens
    assert [o.index for o in outs] == [0, 1, 2, 3] and all(o.request_id == rid for o in outs)
    assert e.stats().computed_tokens - before == prompt_len
    full, partial = divmod(prompt_len, 16)
    assert e.stats().blocks_used == full + (4 if partial else 0)  # full blocks shared, the partial one x4
    while e.has_unfinished():
        e.step()
    # Each choice then computed its own 7 decode tokens (its 8th is sampled, never computed).
    assert e.stats().computed_tokens - before == prompt_len + 4 * 7
    assert e.stats().blocks_used == 0


@pytest.fixture(scope="module")
def shared_engine(demo_path) -> Engine:
    return engine(demo_path)


@pytest.mark.parametrize(
    "prompt_len, max_num_seqs",
    [(37, 256), (32, 256), (37, 2)],  # partial last block or none; forked in place, or queued as requests of their own
)
def test_greedy_choices_equal_a_single_request_token_for_token(shared_engine, prompt_len, max_num_seqs):
    e = shared_engine
    prompt = list(range(500 + prompt_len, 500 + 2 * prompt_len))
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True)
    (alone,) = e.generate([prompt], params)
    assert e.reset_prefix_cache()
    e.scheduler.max_num_seqs = max_num_seqs
    try:
        outs = run(e, prompt, params, 3)
    finally:
        e.scheduler.max_num_seqs = 256
        e.reset_prefix_cache()
    for out in outs:
        assert out.token_ids == alone.token_ids
        assert out.logprobs == pytest.approx(alone.logprobs, abs=TOL)
        assert out.top_logprobs is not None and [sorted(t) for t in out.top_logprobs] == [
            sorted(t) for t in alone.top_logprobs
        ]
        assert out.num_cached_tokens == 0  # the prompt is reused from the fork, not counted as a hit


def test_seeded_choices_are_reproducible_differ_and_match_transformers(demo_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(demo_path), dtype=torch.float32, attn_implementation="eager").eval()
    prompt = list(range(900, 941))  # 2 full blocks and a partial one
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=123, logprobs=0, ignore_eos=True)
    e = engine(demo_path)
    first = run(e, prompt, params, 4)
    again = run(engine(demo_path), prompt, params, 4)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert len({tuple(o.token_ids) for o in first}) == 4
    (alone,) = e.generate([prompt], params)  # choice 0 is the request with the same seed
    assert first[0].token_ids == alone.token_ids
    for out in first:  # each choice's K/V is its own: its logprobs are transformers' on its own prefix
        ids = torch.tensor([prompt + out.token_ids[:-1]])
        with torch.no_grad():
            ref = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1 :].float(), -1)
        assert out.logprobs == pytest.approx([float(ref[i, t]) for i, t in enumerate(out.token_ids)], abs=TOL)


def test_abort_stops_every_choice_and_frees_their_blocks(demo_path):
    e = engine(demo_path)
    rid = e.add_prompt(list(range(50, 90)), SamplingParams(max_tokens=50, ignore_eos=True), n=5)
    e.step()
    e.step()
    assert e.stats().running == 5
    assert e.abort(rid)
    assert not e.has_unfinished() and e.stats().blocks_used == 0
    assert not e.abort(rid)
    with pytest.raises(ValueError, match="n must be"):
        e.add_prompt([1, 2], n=0)


def test_openai_n_choices_over_one_prefill(shared_server):
    client = oa(shared_server)
    nonce = secrets.token_hex(8)  # a prompt no group has cached: all of it is computed
    messages = [{"role": "user", "content": f"{nonce} Tell four short stories about the lighthouse keeper's cat."}]
    kw = dict(model="demo", messages=messages, max_tokens=12, temperature=1.0, seed=77)

    def computed() -> int:
        r = httpx.get(
            f"{shared_server.base}/admin/v1/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
        )
        r.raise_for_status()
        lines = [ln for ln in r.text.splitlines() if ln.startswith("kvgrid_group_computed_tokens")]
        assert lines
        return int(sum(float(ln.rsplit(" ", 1)[1]) for ln in lines))

    before = computed()
    four = client.chat.completions.create(n=4, logprobs=True, **kw)
    after = computed()
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert four.usage.prompt_tokens_details.cached_tokens == 0
    # The engine's computed-token counter: the prompt once, then each choice's decodes (its last token is sampled,
    # never computed).
    assert after - before == four.usage.prompt_tokens + four.usage.completion_tokens - 4
    one = client.chat.completions.create(**kw)
    assert four.usage.prompt_tokens == one.usage.prompt_tokens  # counted once
    assert four.usage.completion_tokens == sum(len(c.logprobs.content) for c in four.choices)
    assert four.choices[0].message.content == one.choices[0].message.content  # choice 0: the same seed
    assert len({c.message.content for c in four.choices}) == 4
    again = client.chat.completions.create(n=4, **kw)
    assert [c.message.content for c in again.choices] == [c.message.content for c in four.choices]
    # Streamed: chunks of every choice, by index, add up to the same texts; usage counts the prompt once.
    texts = ["", "", "", ""]
    usage = None
    for chunk in client.chat.completions.create(n=4, stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert texts == [c.message.content for c in four.choices]
    assert usage is not None and usage.prompt_tokens == one.usage.prompt_tokens
    assert usage.completion_tokens == four.usage.completion_tokens


def test_each_choice_keeps_its_own_structured_output_state(shared_engine):
    """A constrained request's choices each get their own grammar state (made on their first token): every
    choice is a complete JSON object of the schema, and they differ."""
    import json

    import jsonschema

    from common.sampling import StructuredOutput

    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        max_tokens=64, temperature=1.0, seed=5, structured_output=StructuredOutput("json_schema", json.dumps(schema))
    )
    outs = run(shared_engine, list(range(60, 101)), params, 4)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert len({o.text for o in outs}) > 1


def test_the_router_counts_n_choices_as_n_running_requests_after_one_prefill():
    from router.routing.router import Router

    router = Router(["a", "b"], b"secret", block_size=16)
    d = router.route("acme", list(range(40)), "r1", n=4)
    assert router.loads[d.group].queued_prefill_tokens == 40  # the prompt once
    router.on_prefill_done("r1")
    assert router.loads[d.group].running == 4 and router.loads[d.group].queued_prefill_tokens == 0
    router.on_finish("r1")
    assert router.loads[d.group].running == 0
