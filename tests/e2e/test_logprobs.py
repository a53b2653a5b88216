"""Logprobs: the engine's, and what the OpenAI APIs return, equal transformers' log-softmax of the same prefix
(float32, CPU) within 1e-4, in the APIs' own shapes, whole and streamed."""

from __future__ import annotations

import httpx
import pytest
import torch

from common.sampling import SamplingParams
from harness import ACME_KEY, oa
from router.gateway.openai.serving import TokenTexts, _byte_chars
from worker.engine import Engine, EngineConfig

TOL = 1e-4


@pytest.fixture(scope="module")
def hf(demo_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(demo_path), dtype=torch.float32, attn_implementation="eager")
    return model.eval(), AutoTokenizer.from_pretrained(str(demo_path))


def reference(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every output position: row i is the distribution of output token i."""
    ids = torch.tensor([prompt + output[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 :].float()
    return torch.log_softmax(logits, -1)


def assert_logprobs_match(ref: torch.Tensor, output: list[int], logprobs: list[float], tops: list[dict] | None):
    assert len(logprobs) == len(output) == ref.shape[0]
    for i, tok in enumerate(output):
        assert logprobs[i] == pytest.approx(float(ref[i, tok]), abs=TOL), f"token {i}"
        if tops is not None:
            k = len(tops[i])
            vals, idx = ref[i].topk(k)
            assert sorted(tops[i]) == sorted(idx.tolist()), f"top {k} at token {i}"
            for tid, lp in tops[i].items():
                assert lp == pytest.approx(float(ref[i, tid]), abs=TOL)


def test_engine_logprobs_equal_transformers_sampled_and_greedy(demo_path, hf):
    model, _ = hf
    engine = Engine(EngineConfig(model=str(demo_path), device="cpu", num_blocks=128))
    prompts = [list(range(100, 137)), list(range(300, 348)), [5, 6, 7]]
    params = [
        SamplingParams(max_tokens=12, temperature=1.0, seed=3, logprobs=5, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=4, logprobs=20, ignore_eos=True),
    ]
    for prompt, p, out in zip(prompts, params, engine.generate(prompts, params)):
        assert out.logprobs is not None
        assert (out.top_logprobs is None) == (p.logprobs == 0)
        if out.top_logprobs is not None:
            assert all(len(t) == p.logprobs for t in out.top_logprobs)
        assert_logprobs_match(reference(model, prompt, out.token_ids), out.token_ids, out.logprobs, out.top_logprobs)


def test_token_texts_give_each_tokens_exact_bytes(hf):
    _, tok = hf
    texts = TokenTexts(tok)
    assert texts.byte_level
    ids = tok.encode("héllo wörld, 你好 ✓", add_special_tokens=False)
    assert b"".join(bytes(texts(i)[1]) for i in ids) == "héllo wörld, 你好 ✓".encode()
    for i in ids:  # the bytes are the token's own vocabulary entry
        chars = _byte_chars()
        assert tok.convert_tokens_to_ids("".join(chars[b] for b in texts(i)[1])) == i
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert texts(eos) == ("<|im_end|>", list(b"<|im_end|>"))


def _ids_of(token_logprobs) -> list[int]:
    """Chat logprobs carry each token's exact bytes: map them back to the demo tokenizer's ids."""
    return [_piece_id(bytes(t.bytes)) for t in token_logprobs]


_TOKENIZER = None


def _piece_id(raw: bytes) -> int:
    assert _TOKENIZER is not None
    if raw == b"<|im_end|>":
        return _TOKENIZER.convert_tokens_to_ids("<|im_end|>")
    chars = _byte_chars()
    return _TOKENIZER.convert_tokens_to_ids("".join(chars[b] for b in raw))


def test_openai_chat_logprobs_equal_transformers_whole_and_streamed(shared_server, hf):
    global _TOKENIZER
    model, tok = hf
    _TOKENIZER = tok
    client = oa(shared_server)
    messages = [
        {"role": "system", "content": "You are a logprob test."},
        {"role": "user", "content": "Count the stones of the river bank, one by one."},
    ]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    kw = dict(model="demo", messages=messages, max_tokens=10, temperature=1.0, seed=11, logprobs=True, top_logprobs=4)
    whole = client.chat.completions.create(**kw)
    assert whole.usage.prompt_tokens == len(prompt)
    choice = whole.choices[0]
    content = choice.logprobs.content
    assert len(content) == whole.usage.completion_tokens
    output = _ids_of(content)
    ref = reference(model, prompt, output)
    assert_logprobs_match(
        ref,
        output,
        [t.logprob for t in content],
        [{_piece_id(bytes(a.bytes)): a.logprob for a in t.top_logprobs} for t in content],
    )
    for t in content:
        assert len(t.top_logprobs) == 4
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        assert t.token == bytes(t.bytes).decode("utf-8", "replace")
    # Streamed (same seed): the chunks' logprobs, in order, are the whole answer's.
    streamed = []
    text = ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None:
                streamed.extend(c.logprobs.content)
    assert text == choice.message.content
    assert [(t.token, t.bytes) for t in streamed] == [(t.token, t.bytes) for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=TOL)
    # Without logprobs asked, there are none.
    plain = client.chat.completions.create(model="demo", messages=messages, max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_openai_completion_logprobs_equal_transformers_whole_and_streamed(shared_server, hf):
    model, tok = hf
    client = oa(shared_server)
    prompt = [int(t) for t in torch.randint(10, 3000, (40,), generator=torch.Generator().manual_seed(5))]
    kw = dict(model="demo", prompt=prompt, max_tokens=8, temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    lp = whole.choices[0].logprobs
    # Greedy: the chosen tokens are transformers' argmax, one position at a time.
    output: list[int] = []
    for _ in range(8):
        output.append(int(reference(model, prompt, output + [0])[-1].argmax()))
    ref = reference(model, prompt, output)
    assert lp.tokens == [tok.decode([t]) for t in output]
    assert lp.token_logprobs == pytest.approx([float(ref[i, t]) for i, t in enumerate(output)], abs=TOL)
    for i, top in enumerate(lp.top_logprobs):
        vals, idx = ref[i].topk(3)
        assert top == pytest.approx({tok.decode([t]): float(v) for t, v in zip(idx.tolist(), vals.tolist())}, abs=TOL)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                for name, values in streamed.items():
                    values.extend(getattr(c.logprobs, name))
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=TOL)


def test_top_logprobs_without_logprobs_is_refused_by_name(shared_server):
    r = httpx.post(
        f"{shared_server.base}/acme/v1/chat/completions",
        headers={"Authorization": f"Bearer {ACME_KEY}"},
        json={"model": "demo", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("top_logprobs:")
