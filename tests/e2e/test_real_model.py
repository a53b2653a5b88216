"""SmolLM2-135M-Instruct (``model: smollm2``), a real instruct model, end to end: fetched and converted from its
GGUF, then checked against transformers reading the same GGUF file with its own loader (float32) as the reference:
the chat template and tokens, greedy tokens through the engine (cold and over a cached prefix) and through HTTP
(chat and completions, with the official SDK), and structured outputs that must validate on a real model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jsonschema
import openai
import pytest
import torch

from harness import Server, serving

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a concise assistant for a bicycle rental shop in a harbour town. The shop opens at nine and closes "
    "at six. A city bike costs twelve euros a day, an electric bike thirty. Helmets are included."
)
QUESTIONS = [
    "What is the capital of France?",
    "How much does an electric bike cost for one day?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "When does the shop open?",
    "What is two plus three?",
    "Are helmets included?",
    "Translate 'good morning' into French.",
]
MAX_NEW = 24
KEY = "sk-real-model-test-01"


def conversation(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[i]}]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from worker.models.registry import resolve_model

    return resolve_model("smollm2", progress=False)


@pytest.fixture(scope="module")
def reference(smollm2: Path):
    """transformers' model and tokenizer from the same GGUF file, through its own GGUF support."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.models.cache import cache_root
    from worker.models.registry import PACKAGED

    gguf = cache_root() / "downloads" / PACKAGED["smollm2"].filename
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), tok


@pytest.fixture(scope="module")
def expected(reference) -> list[tuple[list[int], list[int], list[float]]]:
    """For each conversation: the prompt ids, transformers' greedy tokens (up to EOS) and their log-probabilities."""
    model, tok = reference
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    out = []
    for i in range(len(QUESTIONS)):
        text = tok.apply_chat_template(conversation(i), tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False).input_ids
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=eos
            )
            new = gen[0, len(ids) :].tolist()
            logp = torch.log_softmax(model(gen).logits[0, len(ids) - 1 : -1].float(), -1)
        if new and new[-1] == eos:
            new, logp = new[:-1], logp[:-1]
        out.append((ids, new, [logp[k, t].item() for k, t in enumerate(new)]))
    return out


def test_chat_template_and_tokens_match_transformers(smollm2: Path, reference) -> None:
    from common.model_config import load_tokenizer
    from router.gateway.chat import encode_chat

    _, ref_tok = reference
    tok = load_tokenizer(smollm2)
    for i in range(len(QUESTIONS)):
        for msgs in (conversation(i), conversation(i)[1:]):  # with and without a system message
            text = ref_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == text
            prompt = encode_chat(tok, msgs)
            assert prompt.text == text
            assert prompt.token_ids == ref_tok(text, add_special_tokens=False).input_ids
    for text in ["Numbers 1234 and 3.14159!", "Ünïcödé, 日本語 and 🙂\ttabs  ", "don't   stop\n\n\n  now"]:
        assert tok(text, add_special_tokens=False).input_ids == ref_tok(text, add_special_tokens=False).input_ids


def test_engine_greedy_tokens_match_transformers_cold_and_cached(smollm2: Path, expected) -> None:
    from common.sampling import SamplingParams
    from worker.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=str(smollm2), device="cpu", block_size=16))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=0)
    eos = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for label in ("cold", "cached"):
        equal, worst = 0, 0.0
        for i, (ids, want, want_logp) in enumerate(expected):
            # A tenant per prompt: nothing cached in the first round, the whole prompt's blocks in the second.
            out = engine.generate([ids], params, tenant=f"t{i}")[0]
            assert (out.num_cached_tokens > 0) == (label == "cached")
            got = out.token_ids[:-1] if out.token_ids[-1:] == [eos] else out.token_ids  # the engine keeps EOS
            equal += got == want
            shared = min(len(want), len(got))
            if got[:shared] == want[:shared]:
                worst = max([worst, *(abs(a - b) for a, b in zip(out.logprobs[:shared], want_logp[:shared]))])
        print(f"engine {label}: {equal}/{len(expected)} greedy outputs equal; largest logprob difference {worst:.2e}")
        assert equal >= len(expected) - 1
        assert worst < 1e-2
    # The answers are English, not noise: the first question's answer names the city.
    assert "Paris" in engine.tokenizer.decode(expected[0][1])


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2: Path):
    defaults = (
        f"model: smollm2\nblock_size: 16\ngroups: 1\ndevice: cpu\nmax_model_len: 2048\nkv_cache_bytes: {256 << 20}\n"
    )
    body = f"tenants:\n  - name: acme\n    api_keys: [{KEY}]\n    cache: {{mode: implicit, min_prefix_tokens: 16}}\n"
    with serving(tmp_path_factory, body, [("acme", KEY)], defaults=defaults) as srv:
        yield srv


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/acme/v1", api_key=KEY, timeout=120, max_retries=0)


def test_http_greedy_answers_match_transformers(server: Server, reference, expected) -> None:
    _, ref_tok = reference
    client = _client(server)
    model = client.models.list().data[0].id
    for label in ("cold", "cached"):
        chat_equal = completion_equal = cached = 0
        for i, (ids, want, _) in enumerate(expected):
            want_text = ref_tok.decode(want, skip_special_tokens=True)
            r = client.chat.completions.create(model=model, messages=conversation(i), max_tokens=MAX_NEW, temperature=0)
            chat_equal += r.choices[0].message.content == want_text
            details = r.usage.prompt_tokens_details
            cached += bool(details and details.cached_tokens)
            text = ref_tok.apply_chat_template(conversation(i), tokenize=False, add_generation_prompt=True)
            c = client.completions.create(model=model, prompt=text, max_tokens=MAX_NEW, temperature=0)
            completion_equal += c.choices[0].text == want_text
            assert c.usage.prompt_tokens == len(ids)
        print(f"HTTP {label}: chat {chat_equal}/8, completions {completion_equal}/8 equal to transformers")
        assert chat_equal >= 7 and completion_equal >= 7
        if label == "cached":
            assert cached == len(expected)  # each chat's prompt was cached by its first round


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 30},
        "country": {"type": "string", "minLength": 1, "maxLength": 30},
        "population_millions": {"type": "number"},
        "landmarks": {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 40},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["city", "country", "population_millions", "landmarks"],
    "additionalProperties": False,
}


def test_json_schema_answers_validate_at_temperature(server: Server) -> None:
    client = _client(server)
    model = client.models.list().data[0].id
    for seed in range(5):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Describe Paris as JSON: city, country, population, landmarks."}],
            max_tokens=200,
            temperature=0.7,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_forced_tool_call_validates(server: Server) -> None:
    client = _client(server)
    model = client.models.list().data[0].id
    params = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    }
    tools = [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": params}}
    ]
    started = time.monotonic()
    for seed in range(3):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What's the weather in Lyon?"}],
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=120,
            temperature=0.7,
            seed=seed,
        )
        calls = r.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(calls[0].function.arguments), params)
    print(f"3 forced calls in {time.monotonic() - started:.1f} s")
