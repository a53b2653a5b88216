"""The cache advisor: where a tenant's consecutive prompts stop matching, and what breaks their common prefix.

Prefix caching reuses a prompt's leading blocks only up to the first token that differs from an earlier prompt.
A short span that changes with every request (a timestamp, a date, a request id, a counter) placed before a long
stable span (the rest of a system prompt, tool definitions) therefore throws away everything after it. The
advisor compares consecutive prompts of a sample (``advise``): for each pair it finds the first difference, then
whether the two prompts agree again shortly after it (``MAX_SPAN_CHARS``) for a long stretch; if so, the span in
between is a varying span before a stable one. Findings at the same place in most pairs become advice: the
message, character and token offset, the varying text, its kind, how many more tokens would be cached if the
span moved to the end of the prompt, and what that saves at the tenant's prices. For explicit (Anthropic-style)
tenants it also reports where a ``cache_control`` breakpoint would pay: at a prefix length that enough prompts
reuse within 5 minutes for their reads to outweigh the write premium.

Everything here is a pure function over prompt views (``PromptView``: text, token ids, token character ends,
message spans); ``view_of_sample`` builds them from the gateway's sampled prompts and ``view_of_messages`` from
messages (``kvgrid advise --file``)."""

from __future__ import annotations

import bisect
import json
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from common.config import PricesConfig
from common.defaults import FIVE_MINUTES_S
from router.gateway.chat import encode_chat
from router.gateway.economics import Prices, dollars

MAX_SPAN_CHARS = 64  # a varying span is at most this long (in each prompt)
ANCHOR_CHARS = 24  # the two prompts agree again when this many characters match
MAX_SPAN_TOKENS, ANCHOR_TOKENS = 24, 8  # the same for prompts known only as token ids
MIN_STABLE_BLOCKS = 2  # a stable span worth moving for is at least this many blocks long
BREAKPOINT_WINDOW_S = FIVE_MINUTES_S  # a 5-minute entry: reuse within this long reads it
BREAKPOINT_LOOKBACK = 64  # ... from one of the this many prompts before
_WORD = re.compile(r"[0-9A-Za-z]")
_JOIN = set("-:._+/")

_KINDS = [  # (kind, pattern over the varying text), first match wins
    ("uuid", re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")),
    ("timestamp", re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{1,2}:\d{2}|\d{1,2}:\d{2}(:\d{2})?|^\d{10}(\d{3})?$")),
    ("date", re.compile(r"\d{4}-\d{2}-\d{2}|\d{1,2}/\d{1,2}/\d{2,4}|\d{1,2}\.\d{1,2}\.\d{2,4}")),
    ("counter", re.compile(r"^#?\d{1,9}$")),
    ("id", re.compile(r"^(?=[-_.:A-Za-z0-9]*\d)[-_.:A-Za-z0-9]{6,}$")),
]


@dataclass
class PromptView:
    """One prompt as the advisor sees it. ``text`` is None for a prompt known only as token ids."""

    token_ids: list[int]
    text: str | None = None
    token_ends: list[int] = field(default_factory=list)  # character end of each token in ``text``
    spans: list[tuple[int, int] | None] = field(default_factory=list)  # each message's content in ``text``
    roles: list[str] = field(default_factory=list)
    time: float = 0.0
    prefix_tokens: int = 0  # tokens before the chat (cached content), counted in the token offsets

    def tokens_before(self, char: int) -> int:
        return self.prefix_tokens + bisect.bisect_right(self.token_ends, char)

    def message_at(self, char: int) -> tuple[int | None, int]:
        """(message index, character offset from its content's start) of ``char``: the last message starting at or
        before it; (None, char) before every content."""
        best: tuple[int | None, int] = (None, char)
        for i, span in enumerate(self.spans):
            if span is not None and span[0] <= char:
                best = (i, char - span[0])  # in it, or in the template text after it
        return best

    def char_of_token(self, token: int) -> int:
        k = token - self.prefix_tokens
        if k <= 0 or not self.token_ends:
            return 0
        return self.token_ends[min(k, len(self.token_ends)) - 1]


def view_of_messages(
    tokenizer,
    messages: list[dict[str, Any]],
    generation: bool = True,
    at: float = 0.0,
    prefix_tokens: int = 0,
    tools: list[dict] | None = None,
) -> PromptView:
    chat = encode_chat(tokenizer, messages, add_generation_prompt=generation, tools=tools)
    return PromptView(
        token_ids=chat.token_ids,
        text=chat.text,
        token_ends=[end for _, end in chat.offsets],
        spans=list(chat.content_spans),
        roles=[str(m.get("role", "")) for m in messages],
        time=at,
        prefix_tokens=prefix_tokens,
    )


def view_of_sample(row: dict[str, Any], tokenizer) -> PromptView:
    """A prompt the gateway sampled (router/gateway/core.py ``Gateway.sample``): messages, or token ids."""
    if row.get("messages") is not None:
        return view_of_messages(
            tokenizer,
            row["messages"],
            bool(row.get("gen", True)),
            float(row.get("t", 0)),
            int(row.get("prefix", 0)),
            row.get("tools"),
        )
    return PromptView(token_ids=list(row.get("token_ids", [])), time=float(row.get("t", 0)))


# -- comparing two prompts ----------------------------------------------------------------------------------------


def common_prefix(a: Sequence, b: Sequence) -> int:
    n = min(len(a), len(b))
    i, step = 0, 256
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _find(hay: Sequence, needle: Sequence, lo: int, hi: int) -> int:
    if isinstance(hay, str):
        return hay.find(needle, lo, hi)  # type: ignore[arg-type]
    k = len(needle)
    for i in range(lo, max(lo, hi - k + 1)):
        if hay[i : i + k] == needle:
            return i
    return -1


def resync(a: Sequence, b: Sequence, p: int, max_span: int, anchor: int) -> tuple[int, int] | None:
    """After a first difference at ``p``: the shortest skips (i in ``a``, j in ``b``, each <= ``max_span``) after
    which the two agree again for ``anchor`` items; None when they do not within the spans."""
    best: tuple[int, int] | None = None
    for j in range(max_span + 1):
        if best is not None and j >= sum(best):
            break
        needle = b[p + j : p + j + anchor]
        if len(needle) < anchor:
            break
        at = _find(a, needle, p, p + max_span + anchor)
        if at >= 0 and (best is None or (at - p) + j < sum(best)):
            best = (at - p, j)
    return best


def _widen(text: str, lo: int, hi: int) -> tuple[int, int]:
    """``[lo, hi)`` grown to the whole token-like word(s) around it (digits, letters, and - : . _ + / between
    them), at most 40 characters each way."""

    def part(c: str) -> bool:
        return bool(_WORD.match(c)) or c in _JOIN

    start, end = lo, hi
    while start > 0 and lo - start < 40 and part(text[start - 1]):
        start -= 1
    while end < len(text) and end - hi < 40 and part(text[end]):
        end += 1
    while start < end and text[start] in _JOIN:
        start += 1
    while end > start and text[end - 1] in _JOIN:
        end -= 1
    return start, end


def kind_of(text: str) -> str:
    for kind, pattern in _KINDS:
        if pattern.search(text):
            return kind
    return "text"


@dataclass
class Break:
    """Where prompt ``b`` stops matching the one before it, and (when found) the varying span before a stable one."""

    token: int  # first token that differs
    message: int | None = None
    char: int | None = None  # of the varying span in the prompt text
    message_char: int | None = None  # ... in its message's content
    varying: str | None = None
    span_tokens: int = 0  # tokens of the varying span
    stable_tokens: int = 0  # tokens of the stable span after it, up to the next difference


def compare(a: PromptView, b: PromptView) -> Break | None:
    """How ``b`` departs from ``a``; None when one is a prefix of the other (nothing was lost)."""
    if a.text is not None and b.text is not None:
        p = common_prefix(a.text, b.text)
        if p >= min(len(a.text), len(b.text)):
            return None
        token = min(b.tokens_before(p), common_prefix(a.token_ids, b.token_ids) + b.prefix_tokens)
        brk = Break(token=token)
        skips = resync(a.text, b.text, p, MAX_SPAN_CHARS, ANCHOR_CHARS)
        if skips is None:
            return brk
        i, j = skips
        stable = common_prefix(a.text[p + i :], b.text[p + j :])
        lo, hi = _widen(b.text, p, p + j) if j else _widen(a.text, p, p + i)
        varying = (b.text[lo:hi] if j else a.text[lo:hi]) or b.text[p : p + j]
        start_token = b.tokens_before(lo)
        end_stable = b.tokens_before(p + j + stable)
        end_span = b.tokens_before(p + j)
        brk.message, brk.message_char = b.message_at(lo)
        brk.char, brk.varying = lo, varying
        brk.token = min(brk.token, start_token)
        brk.span_tokens = max(0, end_span - start_token)
        brk.stable_tokens = max(0, end_stable - end_span)
        return brk
    p = common_prefix(a.token_ids, b.token_ids)
    if p >= min(len(a.token_ids), len(b.token_ids)):
        return None
    brk = Break(token=p + b.prefix_tokens)
    skips = resync(a.token_ids, b.token_ids, p, MAX_SPAN_TOKENS, ANCHOR_TOKENS)
    if skips is not None:
        i, j = skips
        brk.span_tokens = j
        brk.stable_tokens = common_prefix(a.token_ids[p + i :], b.token_ids[p + j :])
        brk.varying = " ".join(map(str, b.token_ids[p : p + j])) or None
    return brk


# -- advice over a sample --------------------------------------------------------------------------------------


def _blocks(n: int, block_size: int) -> int:
    return n // block_size * block_size


def _reported(n: int, min_prefix_tokens: int) -> int:
    return n if n >= min_prefix_tokens else 0


def advise(
    prompts: list[PromptView],
    block_size: int = 16,
    prices: Prices | None = None,
    explicit: bool = False,
    min_prefix_tokens: int = 1,
) -> dict[str, Any]:
    """The advice for a tenant's sampled prompts (oldest first): ``advice`` (varying spans before stable ones,
    most saving first), ``breakpoints`` (explicit tenants: where a ``cache_control`` breakpoint would pay) and
    ``prefix`` (where consecutive prompts stop matching)."""
    prices = prices or Prices()
    pairs = list(zip(prompts, prompts[1:]))
    breaks = [(b, compare(a, b)) for a, b in pairs]
    clusters: list[dict[str, Any]] = []
    for b, brk in breaks:
        if brk is None or brk.stable_tokens < MIN_STABLE_BLOCKS * block_size:
            continue  # no long stable span after the difference: the prompts simply differ from there on
        now = _reported(_blocks(brk.token, block_size), min_prefix_tokens)
        moved = _reported(_blocks(brk.token + brk.stable_tokens, block_size), min_prefix_tokens)
        if moved - now < block_size:
            continue  # not even one more block: not worth moving
        for c in clusters:
            if c["message"] == brk.message and abs(c["_char"] - (brk.message_char or brk.token)) <= 8:
                break
        else:
            c = {"message": brk.message, "_char": brk.message_char or brk.token, "_found": []}
            clusters.append(c)
        c["_found"].append((b, brk, now, moved))
    support = 2 if len(pairs) >= 2 else 1
    advice = []
    saving_per_token = max(0, prices.input - prices.cache_read)
    for c in clusters:
        found = c["_found"]
        if len(found) < support:
            continue
        b, brk, now, moved = found[-1]
        extra = int(statistics.median(m - n for _, _, n, m in found))
        examples = list(dict.fromkeys(f[1].varying for f in found if f[1].varying))[-3:]
        kind = kind_of(examples[-1]) if examples else "text"
        where = (
            f"message {brk.message} ({b.roles[brk.message]})"
            if brk.message is not None and brk.message < len(b.roles)
            else "the prompt"
        )
        advice.append(
            {
                "kind": kind,
                "message": brk.message,
                "role": b.roles[brk.message] if brk.message is not None and brk.message < len(b.roles) else None,
                "char_offset": brk.message_char,
                "prompt_char_offset": brk.char,
                "token_offset": brk.token,
                "block": brk.token // block_size,
                "varying_text": examples,
                "seen_in_pairs": len(found),
                "pairs": len(pairs),
                "cached_tokens_now": now,
                "cached_tokens_if_moved": now + extra,
                "extra_cached_tokens": extra,
                "saving_per_request_usd": dollars(extra * saving_per_token),
                "saving_over_sample_usd": dollars(sum(m - n for _, _, n, m in found) * saving_per_token),
                "suggestion": (
                    f"a {kind} in {where} at character {brk.message_char} changes with every request and sits "
                    f"before {brk.stable_tokens} stable tokens; move it to the end of the prompt (after the "
                    f"stable text) so that {extra} more tokens are cached per request"
                ),
            }
        )
    advice.sort(key=lambda a: (-a["extra_cached_tokens"] * a["seen_in_pairs"], a["token_offset"]))
    out: dict[str, Any] = {"advice": advice, "prefix": _prefix_stats(prompts, breaks, block_size)}
    if explicit:
        out["breakpoints"] = breakpoints(prompts, block_size, prices)
    return out


def _prefix_stats(
    prompts: list[PromptView], breaks: list[tuple[PromptView, Break | None]], block_size: int
) -> dict[str, Any]:
    """Where consecutive prompts stop matching: the median tokens they share and the most common places."""
    shared = [
        (len(b.token_ids) + b.prefix_tokens if brk is None else brk.token, b, brk) for b, brk in breaks
    ]  # tokens b shares with the prompt before it
    places: dict[tuple[int | None, int], int] = {}
    for n, b, brk in shared:
        if brk is not None:
            msg, _ = b.message_at(b.char_of_token(n)) if b.text is not None else (None, 0)
            key = (msg, n // block_size)
            places[key] = places.get(key, 0) + 1
    top = sorted(places.items(), key=lambda kv: -kv[1])[:3]
    return {
        "prompts": len(prompts),
        "median_prompt_tokens": int(statistics.median([len(p.token_ids) + p.prefix_tokens for p in prompts]))
        if prompts
        else 0,
        "median_shared_tokens": int(statistics.median([n for n, _, _ in shared])) if shared else 0,
        "stops": [{"message": m, "block": blk, "token_offset": blk * block_size, "pairs": k} for (m, blk), k in top],
    }


def breakpoints(prompts: list[PromptView], block_size: int, prices: Prices, limit: int = 4) -> list[dict[str, Any]]:
    """Explicit tenants: prefix lengths at which a 5-minute ``cache_control`` breakpoint would pay. A prompt reads
    a breakpoint at ``L`` when an earlier prompt within 5 minutes shared its first ``L`` tokens, else writes it;
    the breakpoint pays when those reads save more than the writes cost over plain input (at the tenant's prices;
    the anthropic preset's when it has none; the earlier prompts are the ``BREAKPOINT_LOOKBACK`` before it). Each
    place is judged on its own; at most ``limit``, best first."""
    if not prices.priced:
        prices = Prices.from_config(PricesConfig(preset="anthropic"))
    reuse = []  # per prompt: tokens it shares with an earlier prompt within the window
    for k, p in enumerate(prompts):
        best = 0
        for q in prompts[max(0, k - BREAKPOINT_LOOKBACK) : k]:
            if p.time - q.time <= BREAKPOINT_WINDOW_S:
                best = max(best, common_prefix(q.token_ids, p.token_ids) + min(q.prefix_tokens, p.prefix_tokens))
        reuse.append(_blocks(best, block_size))
    candidates = sorted({r for r in reuse if r > 0})
    out: list[dict[str, Any]] = []
    for level in candidates:
        reads = sum(1 for r in reuse if r >= level)
        writes = sum(1 for p, r in zip(prompts, reuse) if r < level and len(p.token_ids) + p.prefix_tokens >= level)
        saving = level * (reads * (prices.input - prices.cache_read) - writes * (prices.cache_write_5m - prices.input))
        if reads < 1 or saving <= 0:
            continue
        at = next(
            (p for p, r in zip(prompts, reuse) if r >= level), prompts[0]
        )  # a prompt that reads it: where it ends
        msg, char = at.message_at(at.char_of_token(level)) if at.text is not None else (None, 0)
        out.append(
            {
                "token_offset": level,
                "message": msg,
                "char_offset": char if msg is not None else None,
                "reads": reads,
                "writes": writes,
                "saving_over_sample_usd": dollars(saving),
                "_saving": saving,
                "suggestion": (
                    f"a cache_control breakpoint ending at token {level}"
                    + (f" (message {msg}, character {char})" if msg is not None else "")
                    + f" would be read by {reads} and written by {writes} of {len(prompts)} sampled prompts"
                ),
            }
        )
    out.sort(key=lambda x: -x["_saving"])
    for x in out:
        del x["_saving"]
    return out[:limit]


# -- kvgrid advise ---------------------------------------------------------------------------------------------


def view_of_text(tokenizer, text: str, at: float = 0.0) -> PromptView:
    """A raw prompt (``/v1/completions`` text): one span, its tokens as the tokenizer encodes it."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return PromptView(
        token_ids=list(enc["input_ids"]),
        text=text,
        token_ends=[end for _, end in enc["offset_mapping"]],
        spans=[(0, len(text))],
        roles=["prompt"],
        time=at,
    )


def load_jsonl(path: str, tokenizer) -> list[PromptView]:
    """Prompts from a JSONL file, one a line, oldest first: ``{"messages": [{"role": ..., "content": ...}]}`` (a
    chat, rendered with the model's template, with its ``"tools"`` if given), ``{"prompt": "text"}`` or
    ``{"token_ids": [...]}``; each may carry
    ``"t"`` (seconds; default the line number x 1 s). ValueError naming the line for anything else."""
    views = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                at = float(row.get("t", n)) if isinstance(row, dict) else 0.0
            except (ValueError, TypeError, AttributeError) as exc:
                raise ValueError(f"{path} line {n}: not a JSON object ({exc})") from None
            msgs = row.get("messages") if isinstance(row, dict) else None
            if isinstance(msgs, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
                try:
                    tools = row.get("tools") if isinstance(row.get("tools"), list) else None
                    views.append(view_of_messages(tokenizer, msgs, at=at, tools=tools))
                except ValueError as exc:  # the chat template refused them
                    raise ValueError(f"{path} line {n}: messages: {exc}") from None
            elif isinstance(row.get("prompt"), str):
                views.append(view_of_text(tokenizer, row["prompt"], at))
            elif isinstance(row.get("token_ids"), list) and all(isinstance(i, int) for i in row["token_ids"]):
                views.append(PromptView(token_ids=row["token_ids"], time=at))
            else:
                raise ValueError(
                    f"{path} line {n}: expected messages (a list of {{role, content}}), prompt (text) or token_ids"
                )
    return views


def format_report(report: dict[str, Any]) -> str:
    """``kvgrid advise``'s text output."""
    lines = []
    p = report.get("prefix", {})
    lines.append(
        f"{p.get('prompts', 0)} prompts, median {p.get('median_prompt_tokens', 0)} tokens; consecutive prompts share "
        f"a median {p.get('median_shared_tokens', 0)} leading tokens"
    )
    for s in p.get("stops", []):
        where = f"message {s['message']}, " if s["message"] is not None else ""
        lines.append(
            f"  they stop matching at {where}block {s['block']} (token {s['token_offset']}): {s['pairs']} pairs"
        )
    advice = report.get("advice", [])
    if not advice:
        lines.append("no varying span found before a stable one: nothing to move")
    for a in advice:
        lines.append(f"- {a['suggestion']}")
        lines.append(
            f"  at token {a['token_offset']} (block {a['block']}), seen in {a['seen_in_pairs']} of {a['pairs']} "
            f"pairs, e.g. {', '.join(map(repr, a['varying_text']))}; cached now {a['cached_tokens_now']}, if moved "
            f"{a['cached_tokens_if_moved']}; saves ${a['saving_per_request_usd']:.6f} a request"
        )
    for b in report.get("breakpoints", []) or []:
        lines.append(f"- {b['suggestion']}: saves ${b['saving_over_sample_usd']:.6f} over the sample")
    return "\n".join(lines)
