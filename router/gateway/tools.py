"""Tool calls, shared by the OpenAI and Anthropic gateways: what the model is told, how a forced call is generated,
and how calls are read back out of its output.

- Tools reach the model through its chat template (``encode_chat(..., tools=...)``, in OpenAI's function shape,
  which Hugging Face templates take), earlier calls as the assistant messages' ``tool_calls`` and results as
  ``tool`` messages.
- A template without tool syntax (SmolLM2's: it renders only each message's content) gets them as text instead
  (router/gateway/chat.py decides, per tokenizer): ``tools_prompt`` is put in front of the system message (a new
  first one when there is none), an assistant turn's calls are appended to its content as ``call_text`` blocks,
  and a ``tool`` message's result is wrapped by ``response_text`` (``<tool_response>...</tool_response>``, as
  Hermes does; the message keeps its role ``tool``). All of it is then message content, so request text in it
  never becomes a special token.
- The model answers in the Hermes / Qwen format: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  after any text. ``parse_calls`` reads a whole output, ``CallStream`` a streamed one (text is passed on at once,
  except what may be the start of a ``<tool_call>``; a call is passed on once its closing tag arrived). A block
  may also hold a JSON list of such objects (SmolLM2's documented form ``<tool_call>[{...}, ...]</tool_call>``):
  each is a call, and ``[]`` is a block of no calls.
- When a call is forced (OpenAI ``tool_choice`` ``required`` or a named function, Anthropic ``any`` or ``tool``),
  the output is generated under ``call_grammar``: exactly one ``<tool_call>`` block whose JSON has the name of one
  of the allowed tools and arguments valid for that tool's schema; the request then ends (``stop``).
- Limits (common/json_limits.py), each a ``ValueError`` naming the field (a 400): any tool's schema and any
  earlier call's arguments nest at most ``MAX_JSON_DEPTH`` levels and a schema holds at most ``MAX_SCHEMA_NODES``
  values; a schema compiled into a grammar (a forced call's, ``response_format``'s) passes ``check_schema`` and
  holds no special-token text of the model's tokenizer (the grammar would make the model write that token).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from common.json_limits import MAX_SCHEMA_NODES, check_depth, depth_error
from common.sampling import JSON_STYLE, StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema ({"type": "object"} when the request gave none)

    def template_form(self) -> dict[str, Any]:
        """The definition as chat templates take it (OpenAI's function tool)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # JSON text of an object

    @property
    def input(self) -> dict[str, Any]:
        return json.loads(self.arguments)


def call_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def _special_text(schema: Any, specials: tuple[str, ...], field: str) -> None:
    """``ValueError`` naming ``field`` when text a grammar of ``schema`` would make the model write (property
    names, ``const`` and ``enum`` values: any key or string outside descriptions) holds a special token's text:
    the grammar engine would force the token itself (an end-of-turn marker, say)."""
    if not specials:
        return
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            texts = [node]
        elif isinstance(node, list):
            stack.extend(node)
            continue
        elif isinstance(node, dict):
            texts = list(node)
            stack.extend(v for k, v in node.items() if k not in _PROSE)
        else:
            continue
        for text in texts:
            hit = next((tok for tok in specials if tok in text), None)
            if hit is not None:
                raise ValueError(
                    f"{field}: holds {hit!r}, a special token of the served model, which a constrained output "
                    "cannot write"
                )


_PROSE = frozenset({"description", "title", "$comment", "examples", "default"})  # text no grammar writes


def check_tool_schemas(tools: list[Tool], fields: list[str]) -> None:
    """Every tool's schema, compiled or not (it reaches the chat template): its nesting and size."""
    for t, field in zip(tools, fields):
        if check_depth(t.parameters, field) > MAX_SCHEMA_NODES:
            raise ValueError(f"{field}: the schema has more than {MAX_SCHEMA_NODES} values")


def call_grammar(tools: list[Tool], fields: list[str], specials: tuple[str, ...] = ()) -> StructuredOutput:
    """The grammar of one call of one of ``tools``: ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
    with arguments valid for the named tool's schema. ``ValueError`` naming the tool's schema field (``fields``:
    one per tool, e.g. ``tools.0.function.parameters``) when its schema cannot be compiled into a grammar, or
    holds one of the ``specials`` (the served model's special tokens' texts)."""
    for t, field in zip(tools, fields):
        StructuredOutput("json_schema", json.dumps(t.parameters)).check(field)
        _special_text(t.parameters, specials, field)
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": JSON_STYLE}
    lark = f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: %json {json.dumps(schema)}\n'
    so = StructuredOutput("grammar", lark)
    so.check(fields[0] if len(fields) == 1 else "tools")
    return so


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """What a system message says about ``tools`` (their definitions as the template would take them) for a
    model whose chat template has no tool syntax: SmolLM2's documented block (the definitions as a JSON list in
    ``<tools>``), asking for calls in the one-object-per-block form that ``call_grammar`` also forces."""
    return (
        "You have access to the following tools:\n"
        f"<tools>{json.dumps(tools, ensure_ascii=False)}</tools>\n\n"
        "To call a tool, answer with a JSON object holding the function's name and its arguments within "
        f"{OPEN}{CLOSE} tags, one block per call, after any text:\n"
        f'{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}\n'
        f"The results come back within {RESPONSE_OPEN}{RESPONSE_CLOSE} tags."
    )


def call_text(call: dict[str, Any]) -> str:
    """An earlier call (OpenAI's shape, or just ``{"name", "arguments"}``; arguments an object or JSON text) as
    the model would have written it: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""
    fn = call.get("function", call)
    args = fn.get("arguments")
    args_text = args if isinstance(args, str) else json.dumps({} if args is None else args, ensure_ascii=False)
    name = json.dumps(fn.get("name") or "", ensure_ascii=False)
    return f'{OPEN}\n{{"name": {name}, "arguments": {args_text}}}\n{CLOSE}'


def with_calls(content: str, calls: list[dict[str, Any]]) -> str:
    """An assistant turn's text followed by its calls (``call_text``, one per line), as the model writes them."""
    blocks = [call_text(c) for c in calls]
    return "\n".join([content, *blocks] if content else blocks)


def response_text(content: str) -> str:
    """A tool's result as a ``tool`` message's content, Hermes' way."""
    return f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"


def _call(obj: Any, prefix: str) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
            check_depth(args, "arguments")
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return Call(call_id(prefix), obj["name"], json.dumps(args, ensure_ascii=False))


def _calls(body: str, prefix: str) -> list[Call] | None:
    """The calls of one block's JSON: an object, or a list of objects (each a call; ``[]`` none). None when it
    is not that (the block is then text), nesting too deep included."""
    try:
        obj = json.loads(body)
        check_depth(obj, "tool call")
    except (ValueError, RecursionError):
        return None
    calls = [_call(item, prefix) for item in (obj if isinstance(obj, list) else [obj])]
    return None if None in calls else [c for c in calls if c is not None]


def parse_calls(text: str, prefix: str) -> tuple[str, list[Call]]:
    """(the text without its well-formed tool-call blocks, the calls in order). A block whose JSON does not parse
    as ``{"name": ..., "arguments": {...}}`` or a list of those stays in the text."""
    calls: list[Call] = []
    kept: list[str] = []
    pos, blocks = 0, 0
    for m in _BLOCK.finditer(text):
        got = _calls(m.group(1), prefix)
        if got is None:
            continue
        kept.append(text[pos : m.start()])
        calls += got
        pos, blocks = m.end(), blocks + 1
    kept.append(text[pos:])
    content = "".join(kept)
    return (content.strip() if blocks else content), calls


def _partial_open(text: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``<tool_call>``."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


class CallStream:
    """Splits a streamed output into text and tool calls: ``feed`` each delta, ``finish`` at the end; each returns
    (text to pass on now, calls completed now). Text that may begin a ``<tool_call>`` (and whitespace that may
    precede one) is held back until it is known; a block that does not parse as a call is passed on as text."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._buf = ""
        self._in_call = False
        self.calls: list[Call] = []

    def feed(self, delta: str) -> tuple[str, list[Call]]:
        self._buf += delta
        text, calls = [], []
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE)
                if end < 0:
                    break
                block, self._buf = self._buf[: end + len(CLOSE)], self._buf[end + len(CLOSE) :]
                self._in_call = False
                got = _calls(block[len(OPEN) : -len(CLOSE)].strip(), self.prefix)
                if got is None:
                    text.append(block)
                else:
                    calls += got
                    self._buf = self._buf.lstrip()  # the template's separator after a call
                continue
            at = self._buf.find(OPEN)
            if at < 0:
                keep = len(self._buf) - _partial_open(self._buf)
                while keep and self._buf[keep - 1].isspace():  # may be the separator before a call
                    keep -= 1
                text.append(self._buf[:keep])
                self._buf = self._buf[keep:]
                break
            before = self._buf[:at]
            text.append(before.rstrip())  # the separator before a call is the template's, not text
            self._buf, self._in_call = self._buf[at:], True
        self.calls += calls
        return "".join(text), calls

    def finish(self) -> str:
        """What is still held (an unfinished block or a partial tag): passed on as text."""
        rest, self._buf, self._in_call = self._buf, "", False
        return rest


@dataclass(frozen=True)
class Tooling:
    """What a request's tools mean for its run: the definitions for the template, the grammar of a forced call
    (else the request's own structured output, if any), whether calls are read out of the output, and whether
    only the first call counts (parallel calls off)."""

    template: list[dict[str, Any]] | None = None
    structured: StructuredOutput | None = None
    parse: bool = False
    single: bool = False


def _schema(params: dict[str, Any] | None) -> dict[str, Any]:
    return params if params else {"type": "object"}


def openai_messages(messages) -> list[dict[str, Any]]:
    """OpenAI chat messages as the chat template takes them: the text, and an assistant turn's calls with their
    arguments as objects. ``ValueError`` naming the field for arguments that are not a JSON object."""
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text}
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                field = f"messages.{i}.tool_calls.{j}.function.arguments"
                try:
                    args = json.loads(c.function.arguments)
                except RecursionError:
                    raise depth_error(field) from None
                except ValueError:
                    args = None
                if not isinstance(args, dict):
                    raise ValueError(f"{field}: must be a JSON object (as text)")
                check_depth(args, field)
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
            d["tool_calls"] = calls
        if m.role == "tool" and m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def openai_tooling(body, structured: StructuredOutput | None, specials: tuple[str, ...] = ()) -> Tooling:
    """A chat request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``. ``ValueError`` naming the field
    for a ``tool_choice`` that names no given tool, a schema over the limits, or a forced call whose schema does
    not compile."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: requires tools")
        return Tooling(structured=structured)
    tools = [Tool(t.function.name, t.function.description, _schema(t.function.parameters)) for t in body.tools]
    fields = [f"tools.{i}.function.parameters" for i in range(len(tools))]
    check_tool_schemas(tools, fields)
    template = [t.template_form() for t in tools]
    single = body.parallel_tool_calls is False
    if choice == "none":
        return Tooling(template, structured)
    if choice is None or choice == "auto":
        return Tooling(template, structured, parse=True, single=single)
    if choice == "required":
        return Tooling(template, call_grammar(tools, fields, specials), parse=True, single=True)
    named = [k for k, t in enumerate(tools) if t.name == choice.function.name]
    if not named:
        raise ValueError(f"tool_choice.function.name: no tool named {choice.function.name!r} in tools")
    k = named[0]
    return Tooling(template, call_grammar([tools[k]], [fields[k]], specials), parse=True, single=True)


def anthropic_tooling(body, specials: tuple[str, ...] = ()) -> Tooling:
    """A messages request's ``tools`` / ``tool_choice`` (``auto`` by default, ``any``, ``tool`` with a name,
    ``none``; ``disable_parallel_tool_use``). Also checks the nesting of the earlier calls' ``input``."""
    for i, m in enumerate(body.messages):
        for j, block in enumerate(m.content):
            if block.type == "tool_use":
                check_depth(block.input, f"messages.{i}.content.{j}.input")
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice.type in ("any", "tool"):
            raise ValueError("tool_choice: requires tools")
        return Tooling()
    tools = [Tool(t.name, t.description, _schema(t.input_schema)) for t in body.tools]
    fields = [f"tools.{i}.input_schema" for i in range(len(tools))]
    check_tool_schemas(tools, fields)
    template = [t.template_form() for t in tools]
    kind = "auto" if choice is None else choice.type
    single = choice is not None and choice.disable_parallel_tool_use is True
    if kind == "none":
        return Tooling(template)
    if kind == "auto":
        return Tooling(template, parse=True, single=single)
    if kind == "any":
        return Tooling(template, call_grammar(tools, fields, specials), parse=True, single=True)
    named = [k for k, t in enumerate(tools) if t.name == choice.name]
    if not named:
        raise ValueError(f"tool_choice.name: no tool named {choice.name!r} in tools")
    k = named[0]
    return Tooling(template, call_grammar([tools[k]], [fields[k]], specials), parse=True, single=True)


def response_format(fmt, specials: tuple[str, ...] = ()) -> StructuredOutput | None:
    """OpenAI's ``response_format``: ``text`` (none), ``json_object``, ``json_schema`` (its ``schema``, strict
    or not: the output always follows it). ``ValueError`` naming the field when the schema does not compile or
    holds one of the ``specials``."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput("json_object")
    field = "response_format.json_schema.schema"
    so = StructuredOutput("json_schema", json.dumps(fmt.json_schema.schema_))
    so.check(field)
    _special_text(fmt.json_schema.schema_, specials, field)
    return so
