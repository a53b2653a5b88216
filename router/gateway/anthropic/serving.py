"""The Anthropic-compatible Messages API of every tenant: ``/{tenant}/v1/messages``, whole or streamed (its event
stream), with ``cache_control`` breakpoints: the prompt up to each marked block is pinned on its group for the
block's TTL, and usage reports what was read from the cache and what was written to it. Its bodies are the
models of router/gateway/anthropic/protocol.py; admission, prompts, generation and accounting are the
``Gateway``'s parts (router/gateway/core.py)."""

# No "from __future__ import annotations" here: FastAPI must see real types on the route methods.

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from typing import NamedTuple

from fastapi import Request

from common.defaults import FIVE_MINUTES_S  # a write for longer counts as a one-hour one in usage.cache_creation
from common.outputs import RequestOutput
from router.gateway.anthropic.protocol import (
    AnthropicError,
    AnthropicErrorDetail,
    AnthropicMessageReply,
    AnthropicUsage,
    CacheControl,
    CacheCreation,
    ContentBlock,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensBody,
    InputJsonDelta,
    MessageDelta,
    MessagesRequest,
    MessageStart,
    MessageStop,
    StopInfo,
    TextBlock,
    TextDelta,
    TokenCount,
    ToolResultBlockIn,
    ToolUseBlock,
    ToolUseBlockIn,
    anthropic_event,
)
from router.gateway.chat import ChatPrompt, special_texts
from router.gateway.core import Gateway
from router.gateway.errors import ApiError, err
from router.gateway.generation import GenerateRequest
from router.gateway.routes import Routes
from router.gateway.runs import Run, last, primed, watched
from router.gateway.tenants import Slot, SlotStream, Tenant
from router.gateway.tools import Call, CallStream, Tooling, anthropic_tooling, parse_calls

API = "anthropic"
MAX_BREAKPOINTS = 4
MAX_PIN_TTL_S = 3600.0  # cache_control TTLs: Anthropic's longest

routes = Routes()  # bound to one AnthropicApi by create_app


def _stop_reason(out: RequestOutput) -> str:
    if out.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if isinstance(out.stop_reason, str) else "end_turn"


def _stop_sequence(out: RequestOutput) -> str | None:
    return out.stop_reason if isinstance(out.stop_reason, str) else None


class Claim(NamedTuple):
    """What a request's cache entries claim before it runs: ``write`` tokens of its marked prefix to write after
    ``read`` tokens to read, the TTL of each breakpoint (``ttl_at``: end position -> seconds) and the TTL of
    what lies past the last one (a cached content's)."""

    write: int
    read: int
    ttl_at: dict[int, float]
    fallback_ttl: float

    def start(self, out: RequestOutput) -> int:
        """Where the written part of the marked prefix begins: after what the group actually reused of the claim."""
        return min(self.read, out.num_cached_tokens)

    def segments(self, start: int, n: int) -> list[tuple[int, float]]:
        """The written tokens ``start .. start + n`` as (tokens, TTL) runs: each token is written for the TTL of
        the first breakpoint after it, past the last one for ``fallback_ttl``."""
        out: list[tuple[int, float]] = []
        pos, stop = start, start + n
        for end in sorted(self.ttl_at):
            if pos >= stop:
                break
            if end > pos:
                upto = min(end, stop)
                out.append((upto - pos, self.ttl_at[end]))
                pos = upto
        if pos < stop:
            out.append((stop - pos, self.fallback_ttl))
        return out

    def split(self, start: int, n: int) -> CacheCreation:
        """The written tokens by Anthropic's two kinds: a TTL over five minutes counts as the one-hour kind."""
        long = sum(k for k, ttl in self.segments(start, n) if ttl > FIVE_MINUTES_S)
        return CacheCreation(ephemeral_5m_input_tokens=n - long, ephemeral_1h_input_tokens=long)


def _breakpoints(body: MessagesRequest) -> list[tuple[str, CacheControl, str | None]]:
    """(field, cache_control, the block's text for a text block) of every breakpoint, in request order: tools,
    system, messages."""
    out: list[tuple[str, CacheControl, str | None]] = []
    for k, tool in enumerate(body.tools or []):
        if tool.cache_control:
            out.append((f"tools.{k}.cache_control", tool.cache_control, None))
    for k, b in enumerate(body.system or []):
        if b.cache_control:
            out.append((f"system.{k}.cache_control", b.cache_control, b.text))
    for i, m in enumerate(body.messages):
        for j, block in enumerate(m.content):
            if block.cache_control:
                text = block.text if isinstance(block, ContentBlock) else None
                out.append((f"messages.{i}.content.{j}.cache_control", block.cache_control, text))
    return out


class AnthropicApi:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    @routes.post("/{tenant}/v1/messages")
    async def messages(self, tenant: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        return await self.gw.admission.held(t, request, lambda slot: self._messages(slot, request))

    @routes.post("/{tenant}/v1/messages/count_tokens")
    async def count_tokens(self, tenant: str, request: Request):
        """The prompt tokens a messages request with this body would have (system, tools, messages and any
        cached content, through the same chat encoding), without running it: ``{"input_tokens": n}``. A request
        like any other: within the tenant's in-flight places, request rate and prompt size (413)."""
        t = self.gw.admission.auth(tenant, request, API)
        return await self.gw.admission.held(t, request, lambda _: self._count_tokens(t, request))

    async def _count_tokens(self, t: Tenant, request: Request):
        gw = self.gw
        await gw.admission.admit_request(t, API)
        body: CountTokensBody = await gw.admission.body(request, CountTokensBody, API)
        gw.admission.model_ref(t, body.model, API)
        if (refused := body.unsupported()) is not None:
            raise err(400, refused, API)
        prefix, _ = await gw.prompts.cached_prefix(t, body.cached_content, API)
        chat, _ = await self._prompt(t, body)
        gw.admission.check_size(t, len(prefix) + len(chat.token_ids), 0, API)
        return TokenCount(input_tokens=len(prefix) + len(chat.token_ids))

    async def _messages(self, slot: Slot, request: Request):
        gw, t = self.gw, slot.tenant
        body: MessagesRequest = await gw.admission.body(request, MessagesRequest, API)
        adapter = gw.admission.pick_model(slot, body.model, API)
        adapter_id = None if adapter is None else adapter.id
        if (refused := body.unsupported()) is not None:
            raise err(400, refused, API)
        prefix, cc_ttl = await gw.prompts.cached_prefix(t, body.cached_content, API)
        tooling = await self._tooling(t, body)
        chat, marks = await self._prompt(t, body, tooling)
        prompt = prefix + chat.token_ids
        gw.admission.check_context(prompt, body.max_tokens, "max_tokens", API)
        # Its budget reserves the whole prompt as written at the longest marked TTL (an upper bound).
        mark_ttl = max((ttl for _, ttl in marks), default=0.0)
        await gw.admission.admit(slot, prompt, body.max_tokens, API, chat, len(prompt) if marks else 0, mark_ttl)
        # Breakpoint = the tokens ending at or before the marked block's end; only whole blocks are pinned.
        bs = gw.config.block_size
        ttl_at: dict[int, float] = {}
        for char_end, ttl in marks:
            pos = (len(prefix) + chat.tokens_before(char_end)) // bs * bs
            if pos > 0:
                ttl_at[pos] = max(ttl, ttl_at.get(pos, 0.0))
        pin_tokens = max(ttl_at, default=len(prefix))
        pin_ttl = max(ttl_at.values(), default=cc_ttl or t.config.cache.default_ttl)
        entries = {pos: gw.entries.entry_key(t.name, prompt[:pos], adapter_id) for pos in ttl_at}
        # What the entries claim is read: the longest marked prefix whose entry lives (cached content is pinned
        # already). The usage caps it by what the group actually reused; the rest of the marked prefix is a write.
        claim_read = len(prefix) // bs * bs
        alive = await asyncio.gather(*(gw.entries.ttl_left(t.name, key) for key in entries.values()))
        for pos, left in sorted(zip(entries, alive), reverse=True):
            if pos > claim_read and left is not None:
                claim_read = pos
                break
        claim_write = max(0, pin_tokens - claim_read) if entries else 0
        claim = Claim(claim_write, claim_read, ttl_at, pin_ttl)
        params = gw.prompts.params(
            body.max_tokens,
            body.temperature,
            body.top_p,
            body.stop_sequences,
            None,
            API,
            body.top_k,
            structured_output=tooling.structured,
        )
        writes: list[asyncio.Task] = []  # the entry writes, awaited before the response ends

        def account(out: RequestOutput, predicted: int) -> None:
            usage = self._usage(t, out, claim)
            r, w = usage.cache_read_input_tokens, usage.cache_creation_input_tokens
            gw.accounting.account(slot, out, predicted, r, w, r, write_segments=claim.segments(claim.start(out), w))
            if out.finished and out.finish_reason != "abort":  # the entries exist once the pin does
                for pos, key in entries.items():
                    writes.append(gw.accounting.spawn(gw.entries.keep(t.name, key, ttl_at[pos])))
                if adapter is None:  # keep_alive: auto keeps the base model's entries (it re-pins under no adapter)
                    writes.extend(gw.keep_alive.used(t, prompt, entries, ttl_at, alive))

        req = GenerateRequest(
            t, prompt, params, API, pin_tokens, pin_ttl, account, restartable=not body.stream, adapter=adapter
        )
        run = gw.generation.generate(req)
        run = watched(request, run, API)
        mid = "msg_" + secrets.token_hex(12)
        if body.stream:
            run = await primed(run)
            return SlotStream(self._stream(t, run, mid, claim, writes, tooling if tooling.parse else None))
        out, _ = await last(run)
        await gw.accounting.settle(writes)
        content: list[TextBlock | ToolUseBlock] = [TextBlock(text=out.text)]
        reason = _stop_reason(out)
        if tooling.parse:
            text, calls = parse_calls(out.text, "toolu_")
            if calls:
                calls = calls[:1] if tooling.single else calls
                content = [TextBlock(text=text)] if text else []
                content += [ToolUseBlock(id=c.id, name=c.name, input=c.input) for c in calls]
                reason = "tool_use" if out.finish_reason == "stop" else reason
        return self._reply(mid, content, reason, _stop_sequence(out), self._usage(t, out, claim))

    async def _tooling(self, t: Tenant, body: MessagesRequest) -> Tooling:
        specials = special_texts(self.gw.prompts.tokenizer)
        try:  # the tools' schemas are compiled to check them: off the event loop
            return await self.gw.prompts.compute(t, anthropic_tooling, body, specials, inline=not body.tools)
        except ValueError as exc:
            raise err(400, str(exc), API) from None

    def _reply(
        self,
        mid: str,
        content: list[TextBlock | ToolUseBlock],
        stop_reason: str | None,
        stop_sequence: str | None,
        usage: AnthropicUsage,
    ) -> AnthropicMessageReply:
        return AnthropicMessageReply(
            id=mid,
            model=self.gw.model_id,
            content=content,
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=usage,
        )

    async def _prompt(
        self, t: Tenant, body: MessagesRequest, tooling: Tooling | None = None
    ) -> tuple[ChatPrompt, list[tuple[int, float]]]:
        """The chat prompt, and (character end in its text, TTL) of each ``cache_control`` breakpoint. Tools go
        through the chat template (``tooling.template``); a user turn's ``tool_result`` blocks become ``tool``
        messages before its text, an assistant turn's ``tool_use`` blocks its ``tool_calls``."""
        tooling = tooling or await self._tooling(t, body)
        marked: list[tuple[int, str, float]] = []  # (message index, text, ttl); index -1: a tool definition

        def ttl(cc: CacheControl, field: str = "cache_control.ttl") -> float:
            return self.gw.admission.ttl(cc.ttl, t.config.cache.default_ttl, MAX_PIN_TTL_S, field, API)

        shortest: tuple[float, str] | None = None  # Anthropic's rule: longer TTLs come before shorter ones
        for where, cc, text in _breakpoints(body):
            if text == "":
                raise err(400, f"{where}: cache_control cannot be set on an empty text block", API)
            seconds = ttl(cc, f"{where}.ttl")
            if shortest is not None and seconds > shortest[0]:
                raise err(
                    400,
                    f"{where}.ttl: a breakpoint of {seconds:g}s may not follow one of {shortest[0]:g}s "
                    f"({shortest[1]}): breakpoints with longer TTLs must come before shorter ones",
                    API,
                )
            if shortest is None or seconds < shortest[0]:
                shortest = (seconds, where)

        for tool, form in zip(body.tools or [], tooling.template or []):
            if tool.cache_control:
                marked.append((-1, json.dumps(form, ensure_ascii=False), ttl(tool.cache_control)))
        system_parts: list[str] = []
        for b in body.system or []:
            system_parts.append(b.text or "")
            if b.cache_control:
                marked.append((0, b.text or "", ttl(b.cache_control)))
        messages: list[dict] = [{"role": "system", "content": "\n".join(system_parts)}] if system_parts else []
        for m in body.messages:
            parts = m.content
            for block in parts:
                if isinstance(block, ToolResultBlockIn):
                    if m.role != "user":
                        raise err(400, "messages: tool_result blocks belong in user turns", API)
                    if block.cache_control:
                        marked.append((len(messages), block.text, ttl(block.cache_control)))
                    messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text})
            texts = [b for b in parts if isinstance(b, ContentBlock)]
            uses = [b for b in parts if isinstance(b, ToolUseBlockIn)]
            if uses and m.role != "assistant":
                raise err(400, "messages: tool_use blocks belong in assistant turns", API)
            if not texts and not uses and any(isinstance(b, ToolResultBlockIn) for b in parts):
                continue  # a turn of tool results only
            idx = len(messages)
            message: dict = {"role": m.role, "content": "".join(b.text or "" for b in texts)}
            if uses:
                message["tool_calls"] = [
                    {"id": u.id, "type": "function", "function": {"name": u.name, "arguments": u.input}} for u in uses
                ]
            messages.append(message)
            marked.extend((idx, b.text or "", ttl(b.cache_control)) for b in texts if b.cache_control)
            marked.extend(
                (idx, json.dumps(u.input, ensure_ascii=False), ttl(u.cache_control)) for u in uses if u.cache_control
            )
        if len(marked) > MAX_BREAKPOINTS:
            raise err(400, f"at most {MAX_BREAKPOINTS} cache_control breakpoints are allowed", API)
        chat = await self.gw.prompts.chat(t, messages, API, tools=tooling.template)
        marks, pos = [], 0
        for idx, piece, seconds in marked:
            if idx < 0:  # a tool definition: where the template put its JSON
                at = chat.text.find(piece)
                end = None if at < 0 else at + len(piece)
            else:
                end = chat.find(idx, piece, after=pos)
            if end is None:
                raise err(400, "a cache_control block could not be located in the prompt", API)
            pos = pos if idx < 0 else end
            marks.append((end, seconds))
        return chat, marks

    def _usage(self, t: Tenant, out: RequestOutput, claim: Claim) -> AnthropicUsage:
        """Usage as the group saw it: a read is at most what the group actually reused (an entry that outlived
        its blocks, e.g. after a group restart, reads nothing); what of the marked prefix was not read is a
        write, as far as the group could pin it, split by the TTL it was written for (``cache_creation``)."""
        n_prompt = len(out.prompt_token_ids)
        if not claim.write and not claim.read:  # no breakpoint: implicit reuse, reported per the tenant's policy
            read, write, start = self.gw.accounting.reported_cached(t, out.num_cached_tokens), 0, 0
        else:
            read = start = claim.start(out)
            write = min(claim.read + claim.write - read, max(0, out.num_pinned_tokens - read))
            read += max(0, out.num_cached_tokens - read - write)  # reuse past the breakpoint, honestly
        return AnthropicUsage(
            input_tokens=n_prompt - write - read,
            cache_creation_input_tokens=write,
            cache_read_input_tokens=read,
            output_tokens=len(out.token_ids),
            cache_creation=claim.split(start, write),
        )

    async def _stream(
        self,
        t: Tenant,
        run: Run,
        mid: str,
        claim: Claim,
        writes: list[asyncio.Task],
        tooling: Tooling | None = None,
    ) -> AsyncIterator[str]:
        """The event stream of a request: ``message_start`` once the group has prefilled (its reuse known), the
        content blocks, then ``message_delta`` with the usage and ``message_stop``. Without ``tooling`` (a request
        whose output is not parsed for calls) it is one text block, opened at once. With it, text blocks as the
        text comes, and each tool call, once complete, as a ``tool_use`` block whose input arrives in one
        ``input_json_delta``."""
        parser = CallStream("toolu_") if tooling is not None else None
        index, text_open, num_calls = 0, False, 0

        def events(o: RequestOutput) -> list[str]:
            nonlocal index, text_open, num_calls
            calls: list[Call] = []
            if parser is None:
                text = o.delta_text
            else:
                text, calls = parser.feed(o.delta_text)
                text += parser.finish() if o.finished else ""
            evs = []
            for c in calls:
                if tooling is not None and tooling.single and num_calls:
                    break
                if text_open:
                    evs.append(anthropic_event(ContentBlockStop(index=index)))
                    index, text_open = index + 1, False
                block = ToolUseBlock(id=c.id, name=c.name, input={})
                evs.append(anthropic_event(ContentBlockStart(index=index, content_block=block)))
                delta = InputJsonDelta(partial_json=c.arguments)
                evs.append(anthropic_event(ContentBlockDelta(index=index, delta=delta)))
                evs.append(anthropic_event(ContentBlockStop(index=index)))
                index, num_calls = index + 1, num_calls + 1
            if text:
                if not text_open:
                    evs.append(anthropic_event(ContentBlockStart(index=index, content_block=TextBlock(text=""))))
                    text_open = True
                evs.append(anthropic_event(ContentBlockDelta(index=index, delta=TextDelta(text=text))))
            return evs

        try:
            first = True
            out = None
            async for out, _ in run:
                if first:  # the group has prefilled: its reuse is known
                    usage = self._usage(t, out, claim).model_copy(update={"output_tokens": 0})
                    yield anthropic_event(MessageStart(message=self._reply(mid, [], None, None, usage)))
                    if parser is None:  # plain text: its one block opens with the message
                        yield anthropic_event(ContentBlockStart(content_block=TextBlock(text="")))
                        text_open = True
                    first = False
                for ev in events(out):
                    yield ev
            if out is not None:
                if text_open:
                    yield anthropic_event(ContentBlockStop(index=index))
                reason = _stop_reason(out)
                if num_calls and out.finish_reason == "stop":
                    reason = "tool_use"
                yield anthropic_event(
                    MessageDelta(
                        delta=StopInfo(stop_reason=reason, stop_sequence=_stop_sequence(out)),
                        usage=self._usage(t, out, claim),
                    )
                )
                await self.gw.accounting.settle(writes)  # the run ended, so its entry writes have started
                yield anthropic_event(MessageStop())
        except ApiError as exc:
            yield anthropic_event(AnthropicError(error=AnthropicErrorDetail(type=exc.kind, message=exc.message)))
