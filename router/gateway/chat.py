"""Chat prompts: the model's chat template, rendered and tokenised so that text from a request never becomes a
special token.

A chat template wraps each message in role markers (``<|im_start|>user ... <|im_end|>``), which are special
tokens. Rendering the template to a string and encoding that string would also turn the marker *text* inside a
message into the real tokens, so a user could forge a system turn. Here every message's content is a region of the
rendered text that is known (found by rendering the template a second time with unique placeholders as contents),
and a special token may come only from outside those regions.

For ordinary text the result is exactly ``tokenizer.encode(rendered, add_special_tokens=False)``, the plain path,
so the same conversation prefix always gives the same leading tokens and prefix caching is unaffected. Only when a
special token would come from a message's text is the prompt encoded region by region: the template's pieces as
usual, the messages' texts with special-token matching off (their marker text becomes ordinary tokens).

Only ``/v1/completions`` with a string prompt encodes special-token text as special tokens: a raw prompt is the
caller's own template (vLLM does the same).

Tools: a template with tool syntax renders the definitions (``tools=``) and earlier calls (``tool_calls``) itself,
and the request's JSON in them is found in the text and kept plain like contents. A template without (SmolLM2's
renders only contents; ``tool_syntax`` finds out by rendering probes, once per tokenizer) gets them as message
text (router/gateway/tools.py: the definitions in front of the system message, calls after the assistant's text,
results in ``<tool_response>``): being contents, they are regions like any other."""

from __future__ import annotations

import bisect
import json
import re
import secrets
import time
import weakref
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from router.gateway.tools import RESPONSE_OPEN, response_text, tools_prompt, with_calls


class ChatTemplateError(ValueError):
    """The chat template refused the messages (for example roles that do not alternate), or rewrites their
    contents so that they cannot be kept apart from its own text."""


@dataclass(frozen=True)
class ChatSource:
    """What a chat prompt was rendered from: the request's messages, whether a generation prompt was added, and
    its tools (the cache advisor's sample keeps them)."""

    messages: list[dict[str, Any]]
    generation: bool
    tools: list[dict[str, Any]] | None


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat: its text, its token ids, the character span of each token in ``text``, the character span
    of each message's content (by message index; ``None`` for one the template left out), and its ``source``."""

    text: str
    token_ids: list[int]
    offsets: list[tuple[int, int]]
    content_spans: list[tuple[int, int] | None]
    source: ChatSource | None = None

    def find(self, message: int, piece: str, after: int = 0) -> int | None:
        """Where ``piece`` (text of message ``message``'s content) ends in ``text``: searched from where that
        content starts (and from ``after``), so equal text earlier cannot match; stripped if the template trims
        it. None when it is not there."""
        start = max(after, (self.content_spans[message] or (0, 0))[0])
        at = self.text.find(piece, start)
        if at < 0:
            piece = piece.strip()  # templates that trim content
            at = self.text.find(piece, start)
        return None if at < 0 else at + len(piece)

    def tokens_before(self, char_end: int) -> int:
        """How many of the prompt's tokens end at or before character ``char_end``."""
        return sum(1 for _, end in self.offsets if end <= char_end)


def _apply(
    tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None
) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except TemplateError as exc:
        raise ChatTemplateError(str(exc)) from None


def _align(text: str, template: list[str], contents: list[str]) -> list[tuple[int, int]] | None:
    """Where each of ``contents`` lies in ``text`` = template[0] + content + template[1] + ..., each content as is
    or stripped (templates often ``| trim`` it); ``None`` when ``text`` is not of that form."""
    spans, pos = [], 0
    for k, content in enumerate(contents):
        if not text.startswith(template[k], pos):
            return None
        pos += len(template[k])
        for shown in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
            if text.startswith(shown, pos) and text.startswith(template[k + 1], pos + len(shown)):
                break
        else:
            return None
        spans.append((pos, pos + len(shown)))
        pos += len(shown)
    return spans if pos + len(template[-1]) == len(text) and text.endswith(template[-1]) else None


def _render(
    tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, list[tuple[int, tuple[int, int]]]]:
    """The chat text of ``messages`` (each with a string ``content``), and (message index, character span) of every
    place where the template put a content, in text order.

    The text is the template's own rendering. When the template transforms contents in a way that cannot be
    traced (anything beyond stripping whitespace, or branching on what a content says), the contents are put
    verbatim where the template put the placeholders instead: the prompt then differs a little from the template's
    rendering, but the regions stay exact, which is what keeps the markers safe. A template that cuts contents
    up (so a placeholder does not survive whole) is refused with ``ChatTemplateError``."""
    nonce = secrets.token_hex(8)  # unguessable, so no content can contain a placeholder
    slot = re.compile(f"{nonce}s([0-9]+)e{nonce}", re.IGNORECASE)  # survives | upper, | lower, | title
    marked = [{**m, "content": f"{nonce}s{i}e{nonce}"} for i, m in enumerate(messages)]
    pieces = slot.split(_apply(tokenizer, marked, add_generation_prompt, tools))
    template, order = pieces[0::2], [int(i) for i in pieces[1::2]]
    if any(end in piece.lower() for piece in template for end in (nonce[:8], nonce[-8:])):
        # Contents cut or rewritten beyond recognition (``content[:100]``): their regions cannot be known.
        raise ChatTemplateError(
            "the model's chat template rewrites message contents in a way that cannot be "
            "rendered safely; use a template that inserts them as they are"
        )
    contents = [messages[i]["content"] for i in order]
    text = _apply(tokenizer, messages, add_generation_prompt, tools)
    spans = _align(text, template, contents)
    if spans is None:
        text, spans = template[0], []
        for content, after in zip(contents, template[1:]):
            spans.append((len(text), len(text) + len(content)))
            text += content + after
    return text, list(zip(order, spans))


def _special_ids(tokenizer) -> set[int]:
    """Every special token, the additional ones included (Llama 3's reserved ids, ChatML's markers)."""
    return {i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special}


_SPECIAL_TEXTS: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()


def special_texts(tokenizer) -> tuple[str, ...]:
    """The text of every special token (what a grammar must not make the model write: router/gateway/tools.py),
    cached per tokenizer object."""
    try:
        known = _SPECIAL_TEXTS.get(tokenizer)
    except TypeError:  # not weakly referable: no cache
        known = None
    if known is None:
        known = tuple(t for t in tokenizer.convert_ids_to_tokens(sorted(_special_ids(tokenizer))) if t)
        try:
            _SPECIAL_TEXTS[tokenizer] = known
        except TypeError:
            pass
    return known


def _encode(tokenizer, text: str, plain_text: bool) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=plain_text)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def _json_texts(tools: list[dict[str, Any]] | None, messages: list[dict[str, Any]]) -> list[str]:
    """The request's JSON that a template renders with ``tojson`` (tool definitions, the arguments and names of
    earlier tool calls), as transformers' ``tojson`` writes it."""
    texts = [json.dumps(tool, ensure_ascii=False) for tool in tools or []]
    for m in messages:
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call)
            args = fn.get("arguments")
            texts += [fn.get("name") or "", args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)]
    return texts


def _json_regions(tokenizer, text: str, pieces: list[str]) -> list[tuple[int, int]]:
    """Where the pieces of request JSON that hold special-token text lie in ``text`` (every place), to be encoded
    as plain text like message contents. Only such pieces are looked for: ordinary JSON cannot forge a marker.
    ``ChatTemplateError`` when one of them is not in the text as is (the template rewrites it)."""
    specials = [tokenizer.convert_ids_to_tokens(i) for i in sorted(_special_ids(tokenizer))]
    regions = []
    for piece in pieces:
        if not any(tok in piece for tok in specials):
            continue
        at = text.find(piece)
        if at < 0:
            raise ChatTemplateError(
                "a tool definition or tool call holds special-token text that the chat template does not render "
                "as is, so it cannot be kept apart from the template's own markers"
            )
        while at >= 0:
            regions.append((at, at + len(piece)))
            at = text.find(piece, at + len(piece))
    return regions


@dataclass(frozen=True)
class ToolSyntax:
    """What a chat template does with tools: renders the definitions it is given (``tools``), renders an assistant
    message's ``tool_calls`` (``calls``)."""

    tools: bool
    calls: bool


_PROBE_TOOL, _PROBE_CALL = "kvgrid_probe_tool_7q3z", "kvgrid_probe_call_7q3z"
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {"name": _PROBE_TOOL, "description": "A probe.", "parameters": {"type": "object"}},
    }
]
_PROBE_CALLS = [{"id": "probe0001", "type": "function", "function": {"name": _PROBE_CALL, "arguments": {"n": 1}}}]
_SYNTAX: weakref.WeakKeyDictionary[Any, tuple[Any, ToolSyntax]] = weakref.WeakKeyDictionary()


def _shows(tokenizer, needle: str, messages: list[dict[str, Any]], generation: bool) -> bool:
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=_PROBE_TOOLS, add_generation_prompt=generation, tokenize=False
        )
    except Exception:  # a template that refuses the probe has no syntax for it
        return False
    return isinstance(text, str) and needle in text


def tool_syntax(tokenizer) -> ToolSyntax:
    """Whether the tokenizer's chat template renders tool definitions and earlier tool calls: it does when a probe
    tool's name (a probe call's) is in its rendering of a conversation that has one. Cached per tokenizer object
    and template."""
    template = getattr(tokenizer, "chat_template", None)
    try:
        known = _SYNTAX.get(tokenizer)
    except TypeError:  # not weakly referable: no cache
        known = None
    if known is not None and known[0] == template:
        return known[1]
    user = {"role": "user", "content": "Call the tool."}
    call = {"role": "assistant", "content": "", "tool_calls": _PROBE_CALLS}
    result = {"role": "tool", "tool_call_id": "probe0001", "name": _PROBE_CALL, "content": "1"}
    syntax = ToolSyntax(
        tools=_shows(tokenizer, _PROBE_TOOL, [user], True),
        calls=_shows(tokenizer, _PROBE_CALL, [user, call, result], True)
        or _shows(tokenizer, _PROBE_CALL, [user, call], False),
    )
    try:
        _SYNTAX[tokenizer] = (template, syntax)
    except TypeError:
        pass
    return syntax


def _tools_as_text(
    tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, int, list[tuple[int, int] | None]]:
    """What the template is given for a template without tool syntax (``tool_syntax``): the messages with the tools
    and calls it would not render as their text, the tools it still renders, how many messages were put in front
    (a new system message), and for each of the request's messages where its own content lies in the new content
    (None: unchanged)."""
    own: list[tuple[int, int] | None] = [None] * len(messages)
    if not tools and not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return messages, tools, 0, own
    syntax = tool_syntax(tokenizer)
    shown = list(messages)
    if not syntax.calls:
        for i, m in enumerate(messages):
            text = m.get("content") or ""
            if m.get("tool_calls"):
                shown[i] = {k: v for k, v in m.items() if k != "tool_calls"}
                shown[i]["content"] = with_calls(text, m["tool_calls"])
                own[i] = (0, len(text))
            elif m.get("role") == "tool":
                shown[i] = {**m, "content": response_text(text)}
                own[i] = (len(RESPONSE_OPEN) + 1, len(RESPONSE_OPEN) + 1 + len(text))
    if not tools or syntax.tools:
        return shown, tools, 0, own
    block = tools_prompt(tools)
    if shown and shown[0].get("role") == "system":
        text = shown[0].get("content") or ""
        shown[0] = {**shown[0], "content": f"{block}\n\n{text}" if text else block}
        own[0] = (len(shown[0]["content"]) - len(text), len(shown[0]["content"]))
        return shown, None, 0, own
    return [{"role": "system", "content": block}, *shown], None, 1, own


def _own_span(text: str, content: str, span: tuple[int, int], own: tuple[int, int]) -> tuple[int, int]:
    """Where ``content[own[0]:own[1]]`` lies in ``text``, given that ``content`` (perhaps stripped by the template)
    is at ``span``."""
    a, b = span
    lead = max(0, content.find(text[a:b])) if b > a else 0
    return min(max(a, a - lead + own[0]), b), min(max(a, a - lead + own[1]), b)


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping spans covering the same characters."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def encode_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    marks: list[int] | None = None,
) -> ChatPrompt:
    """Render ``messages`` with the tokenizer's chat template and tokenise the result so that special tokens come
    only from the template, never from a message's text. Raises ``ChatTemplateError`` when the template refuses the
    messages. The one way any API turns messages into a prompt (``Prompts.chat``, router/gateway/prompts.py).

    ``tools``: the function definitions the template renders (transformers' ``tools=``: OpenAI's
    ``{"type": "function", "function": {...}}`` shape). An assistant message may carry ``tool_calls`` (OpenAI's
    shape, arguments as a dict or a JSON string), a ``tool`` message a result as its content. Special-token text
    in that JSON is encoded as plain text too. A template without tool syntax gets them as message text
    (``_tools_as_text``); the content spans are still those of the request's messages' own texts.

    ``marks``: when given, ``time.time_ns()`` once the template is rendered is appended to it (the gateway's
    ``template`` and ``tokenize`` spans, router/gateway/tracing.py)."""
    source = ChatSource(messages, add_generation_prompt, tools)
    shown, rendered_tools, first, own = _tools_as_text(tokenizer, messages, tools)
    text, placed = _render(tokenizer, shown, add_generation_prompt, rendered_tools)
    if marks is not None:
        marks.append(time.time_ns())
    by_message: list[tuple[int, int] | None] = [None] * len(messages)
    for k, span in placed:
        i = k - first
        if i >= 0 and by_message[i] is None:  # a content the template repeats: its first place
            mine = own[i]
            by_message[i] = span if mine is None else _own_span(text, shown[k]["content"], span, mine)
    ids, offsets = _encode(tokenizer, text, plain_text=False)
    regions = sorted({span for _, span in placed if span[0] < span[1]})
    if rendered_tools or any(m.get("tool_calls") for m in shown):
        regions = _merge(regions + _json_regions(tokenizer, text, _json_texts(rendered_tools, shown)))
    starts = [a for a, _ in regions]
    special = _special_ids(tokenizer)

    def in_content(start: int, end: int) -> bool:
        k = bisect.bisect_right(starts, start) - 1  # the last region starting at or before the token
        if k >= 0 and start < regions[k][1]:
            return True
        return k + 1 < len(regions) and regions[k + 1][0] < end

    if not any(t in special and in_content(*o) for t, o in zip(ids, offsets)):
        return ChatPrompt(text, ids, offsets, by_message, source)
    ids, offsets, pos = [], [], 0
    for region in [*regions, (len(text), len(text))]:
        for lo, hi, plain in ((pos, region[0], False), (region[0], region[1], True)):
            if hi > lo:
                part_ids, part_offsets = _encode(tokenizer, text[lo:hi], plain)
                ids += part_ids
                offsets += [(lo + a, lo + b) for a, b in part_offsets]
        pos = region[1]
    return ChatPrompt(text, ids, offsets, by_message, source)
