"""Structured outputs in the engine: JSON-schema constrained decoding (worker/structured.py, the sampler's masks)
on the random-weight demo model, batched with unconstrained requests."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from common.sampling import SamplingParams, StructuredOutput
from worker.engine import Engine, EngineConfig
from worker.sampler import Sampler

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "kind", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(model="demo", device="cpu", num_blocks=1024, secret=b"test-secret"))


def _so(schema: dict) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema))


def test_json_schema_100_of_100_at_temperature_1(engine: Engine) -> None:
    """100 sampled outputs (temperature 1, different seeds, one batch with unconstrained requests) all parse and
    validate against the schema, and all end with ``stop`` when the JSON is complete, before max_tokens."""
    prompt = engine.tokenizer.encode("Describe a pet as JSON:")
    constrained = [
        SamplingParams(max_tokens=256, temperature=1.0, seed=i, structured_output=_so(SCHEMA)) for i in range(100)
    ]
    free = [SamplingParams(max_tokens=24, temperature=1.0, seed=i, ignore_eos=True) for i in range(8)]
    outs = engine.generate([prompt] * 108, constrained + free)
    texts = set()
    for out in outs[:100]:
        assert out.finish_reason == "stop", out.text
        assert len(out.token_ids) < 256
        jsonschema.validate(json.loads(out.text), SCHEMA)
        texts.add(out.text)
    assert len(texts) > 50  # sampled, not one output repeated
    # The unconstrained rows of the same batches are not masked: free text, all of max_tokens.
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in outs[100:])
    assert any(not o.text.lstrip().startswith("{") for o in outs[100:])


def test_json_object_and_greedy(engine: Engine) -> None:
    """``json_object``: the output is a JSON object, whatever the random model prefers; greedy decoding too."""
    prompt = engine.tokenizer.encode("Hello")
    schema = {
        "type": "object",
        "properties": {"x": {"enum": [1, 2, 3]}},
        "required": ["x"],
        "additionalProperties": False,
    }
    out = engine.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0, structured_output=_so(schema)))[0]
    assert out.finish_reason == "stop" and json.loads(out.text)["x"] in (1, 2, 3)
    # json_object: the random model would write keys without end (any string); the first token must open an
    # object all the same, and the text so far is a prefix of JSON.
    obj = StructuredOutput("json_object")
    out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=3, structured_output=obj))[0]
    assert out.text.lstrip().startswith("{")


def test_max_tokens_mid_json_ends_with_length(engine: Engine) -> None:
    prompt = engine.tokenizer.encode("Describe a pet as JSON:")
    out = engine.generate(
        [prompt], SamplingParams(max_tokens=3, temperature=1.0, seed=1, structured_output=_so(SCHEMA))
    )
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 3
    with pytest.raises(ValueError):
        json.loads(out[0].text)


def test_logprobs_of_constrained_rows_are_the_models(engine: Engine) -> None:
    """Log-probabilities of a constrained request are those of the model's own distribution (finite, the same
    as the unconstrained request's for the same chosen token), not of the masked one."""
    prompt = engine.tokenizer.encode("Describe a pet as JSON:")
    so = _so(SCHEMA)
    masked, free = engine.generate(
        [prompt, prompt],
        [
            SamplingParams(max_tokens=1, temperature=0.0, logprobs=3, structured_output=so),
            SamplingParams(max_tokens=1, temperature=0.0, logprobs=3),
        ],
    )
    assert engine.tokenizer.decode(masked.token_ids).startswith("{")
    assert free.top_logprobs is not None and masked.top_logprobs is not None
    assert masked.top_logprobs[0] == pytest.approx(free.top_logprobs[0])  # the same distribution's top 3
    tok = masked.token_ids[0]
    assert masked.logprobs is not None and torch.isfinite(torch.tensor(masked.logprobs[0]))
    if tok == free.token_ids[0]:
        assert masked.logprobs[0] == pytest.approx(free.logprobs[0])


def test_bad_schema_is_a_value_error_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"^structured_output\.spec: .*foo"):
        SamplingParams(structured_output=StructuredOutput("json_schema", json.dumps({"type": "foo"})))
    with pytest.raises(ValueError, match=r"^structured_output\.spec: the JSON schema is not valid JSON"):
        SamplingParams(structured_output=StructuredOutput("json_schema", "{"))
    with pytest.raises(ValueError, match=r"^structured_output\.kind"):
        SamplingParams(structured_output=StructuredOutput("yaml", ""))
    with pytest.raises(ValueError, match=r"^structured_output must be"):
        SamplingParams(structured_output={"type": "json_object"})  # type: ignore[arg-type]


def test_mask_on_a_batch_masks_only_its_rows(engine: Engine) -> None:
    """The sampler masks the constrained rows of a batch in one call and leaves the others exactly as they were."""
    grammars = engine.sampler.grammars
    assert grammars is not None
    so = _so({"enum": ["yes", "no"]})
    m = grammars.matcher(so)
    logits = torch.randn(3, engine.model_config.vocab_size)
    before = logits.clone()
    grammars.apply(logits, [1], [m])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(
        engine.tokenizer.decode([t])
        and '"yes"'.startswith(engine.tokenizer.decode([t]))
        or '"no"'.startswith(engine.tokenizer.decode([t]))
        for t in allowed
    )


def test_sampler_without_grammars_fails_the_row_alone() -> None:
    from worker.sequence import Sequence

    sampler = Sampler(0)
    seqs = [
        Sequence(
            "a", [1], SamplingParams(temperature=0.0, structured_output=StructuredOutput("json_object")), "t", b""
        ),
        Sequence("b", [1], SamplingParams(temperature=0.0), "t", b""),
    ]
    res = sampler(torch.randn(2, 64), seqs)
    assert isinstance(res[0], ValueError) and not isinstance(res[1], Exception)
