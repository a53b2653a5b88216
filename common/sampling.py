"""Per-request sampling parameters, validated at construction so a bad request fails before it is queued."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from common.json_limits import check_schema, depth_error

# Limits that keep one request's cost per step bounded (stop strings are searched after every token).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
_INT32_MAX = 2**31 - 1
MAX_GRAMMAR_CHARS = 2**20
STRUCTURED_KINDS = ("json_object", "json_schema", "grammar")
# How constrained JSON is written: no free whitespace (a sampled model could otherwise emit it without end), and the
# separators of ``json.dumps``, which chat templates use for tool calls too.
JSON_STYLE: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output, enforced token by token (worker/structured.py, with llguidance).

    ``kind``: ``"json_object"`` (any JSON object; ``spec`` unused), ``"json_schema"`` (``spec``: the JSON schema,
    as JSON text) or ``"grammar"`` (``spec``: an llguidance Lark grammar, which may embed JSON schemas with
    ``%json {...}``: how a forced tool call is generated). The output ends (``stop``) as soon as the grammar is
    complete. ``check()`` raises ``ValueError`` naming the field for a kind, a spec or a grammar that does not
    compile."""

    kind: str
    spec: str = ""

    def grammar(self) -> str:
        """The llguidance grammar (its JSON form) of this constraint."""
        from llguidance import LLMatcher  # here, so that importing the sampling vocabulary stays light

        if self.kind == "grammar":
            return LLMatcher.grammar_from_lark(self.spec)
        schema: Any = {"type": "object"} if self.kind == "json_object" else json.loads(self.spec)
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)  # type: ignore[arg-type]

    def check(self, field: str = "structured_output.spec") -> None:
        """Raise ``ValueError`` unless this constraint compiles; a problem of the spec is reported under ``field``
        (a gateway names its own request field, e.g. ``response_format.json_schema.schema``)."""
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured_output.kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{field} must be a string of at most {MAX_GRAMMAR_CHARS} characters")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except RecursionError:
                raise depth_error(field) from None
            except ValueError:
                raise ValueError(f"{field}: the JSON schema is not valid JSON") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"{field}: a JSON schema must be an object or a boolean")
            check_schema(schema, field)  # nesting, size, patterns, $ref recursion: before the engine sees it
        from llguidance import LLMatcher

        try:
            problem = LLMatcher.validate_grammar(self.grammar())
        except (ValueError, TypeError) as exc:
            problem = str(exc) or type(exc).__name__
        if problem:
            raise ValueError(f"{field}: {problem.strip().splitlines()[0]}")


@dataclass
class SamplingParams:
    """How to pick output tokens for one request.

    ``temperature`` in [0, 100]; below 1e-5 is greedy (dividing logits by less overflows). ``top_p`` in (0, 1]
    (1 disables it; the most likely token is always kept). ``top_k`` >= -1 (0 or -1 disable it). ``min_p`` in
    [0, 1]: tokens less likely than ``min_p`` times the most likely one are dropped (0 disables it).
    ``repetition_penalty`` in (0, 10]: the logits of every token already in the prompt or the output are divided
    by it when positive and multiplied by it when negative (1 disables it; greedy requests too). ``seed`` (any
    64-bit integer) makes a sampled request reproducible on its own, whatever else is in the batch. ``stop``
    strings (at most 16, each 1 to 512 characters) end the output and are cut from the text;
    ``stop_token_ids`` (at most 64) and, unless ``ignore_eos``, the model's EOS end it too (the token stays in
    ``token_ids``, as in transformers' ``generate``). ``logprobs``: ``None`` for none, ``0`` for the chosen
    tokens' log-probabilities, ``n`` in 1..20 to also return the ``n`` most likely alternatives.
    Log-probabilities are those of the model's distribution before temperature and filtering (and before a
    ``structured_output`` mask). ``structured_output``: a ``StructuredOutput`` the output must match (JSON, a
    JSON schema, a grammar). Anything else raises ``ValueError`` naming the field.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a string or a list of strings")
        if any(not 1 <= len(s) <= MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError("stop_token_ids must be a list of non-negative token ids")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"
            )
        if not all(_is_int(t) and 0 <= t <= _INT32_MAX for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative token ids")
        self.stop_token_ids = list(self.stop_token_ids)
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= _INT32_MAX:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= _INT32_MAX:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1: no limit), got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            limit = MAX_REPETITION_PENALTY
            raise ValueError(f"repetition_penalty must be a number in (0, {limit:g}], got {self.repetition_penalty!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise ValueError("structured_output must be a StructuredOutput or None")
            self.structured_output.check()
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        self.min_p, self.repetition_penalty = float(self.min_p), float(self.repetition_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
