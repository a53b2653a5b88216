"""``/{tenant}/v1/completions``: a text prompt (tokenized as given, special-token text matched: it is the caller's
own template) or token ids, answered as a ``TextCompletion`` or streamed as ``text_completion`` events, with the
legacy logprobs shape (text offsets)."""

# No "from __future__ import annotations" here: FastAPI must see real types on the route methods.

from fastapi import Request

from common.outputs import RequestOutput
from router.gateway.errors import err
from router.gateway.openai.protocol import (
    CompletionChoice,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionRequest,
    OpenAIUsage,
    TextCompletion,
)
from router.gateway.openai.serving import API, OpenAIServing, finite
from router.gateway.routes import Routes
from router.gateway.tenants import Slot
from router.gateway.tools import Tooling

routes = Routes()  # bound to one Completions by create_app


class Completions(OpenAIServing):
    ID_PREFIX = "cmpl-"
    OBJECT = "text_completion"

    @routes.post("/{tenant}/v1/completions")
    async def completions(self, tenant: str, request: Request):
        t = self.gw.admission.auth(tenant, request, API)
        return await self.gw.admission.held(t, request, lambda slot: self._completions(slot, request))

    async def _completions(self, slot: Slot, request: Request):
        gw, t = self.gw, slot.tenant
        body: CompletionRequest = await self._read(slot, request, CompletionRequest)
        prefix, ttl = await gw.prompts.cached_prefix(t, body.cached_content, API)
        if isinstance(body.prompt, str):
            tokens = await gw.prompts.encode_text(t, body.prompt, API)
        else:
            tokens = list(body.prompt)
        if tokens and not (0 <= min(tokens) and max(tokens) < gw.prompts.vocab_size):
            raise err(400, "prompt: token id outside the vocabulary", API)
        if "max_tokens" in body.model_fields_set:  # the default (16) is capped by the engine instead
            gw.admission.check_context(prefix + tokens, body.max_tokens, "max_tokens", API)
        prompt = prefix + tokens
        return await self._respond(slot, request, body, prompt, len(prefix), ttl, body.max_tokens, Tooling())

    def _logprobs_asked(self, body: CompletionRequest) -> int | None:
        return body.logprobs

    def _whole(
        self, rid: str, created: int, usage: OpenAIUsage, outs: list[RequestOutput], tooling: Tooling
    ) -> TextCompletion:
        return TextCompletion(
            id=rid,
            created=created,
            model=self.gw.model_id,
            usage=usage,
            choices=[
                CompletionChoice(
                    index=out.index,
                    text=out.text,
                    finish_reason=out.finish_reason,
                    logprobs=self._logprobs(out, len(out.token_ids), 0),
                )
                for out in outs
            ],
        )

    def _logprobs(self, out: RequestOutput, num_new: int, offset: int) -> CompletionLogprobs | None:
        """The legacy completions shape of the logprobs of ``out``'s last ``num_new`` tokens, their text offsets
        counted from ``offset`` (None when not asked for)."""
        if out.logprobs is None:
            return None
        texts, start = self.token_texts, len(out.token_ids) - num_new
        tops = out.top_logprobs or []
        lp = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for i in range(start, len(out.token_ids)):
            token = texts(out.token_ids[i])[0]
            lp.tokens.append(token)
            lp.token_logprobs.append(finite(out.logprobs[i]))
            top = {texts(tid)[0]: finite(v) for tid, v in (tops[i].items() if i < len(tops) else ())}
            top[token] = finite(out.logprobs[i])  # the chosen token is always among them, as in OpenAI's API
            lp.top_logprobs.append(top)
            lp.text_offset.append(offset)
            offset += len(token)
        return lp

    # -- the stream ----------------------------------------------------------------------------------------------

    def _stream_state(self, n: int, tooling: Tooling) -> list[int]:
        return [0] * n  # each choice's text offset of its next token

    def _plain(self, index: int, text: str) -> CompletionChunkChoice:
        return CompletionChunkChoice(index=index, text=text, finish_reason=None)

    def _choices(self, out: RequestOutput, new: int, offsets: list[int]) -> list[CompletionChunkChoice]:
        lp = self._logprobs(out, new, offsets[out.index]) if new else None
        if lp is not None and lp.tokens:
            offsets[out.index] = lp.text_offset[-1] + len(lp.tokens[-1])
        return [
            CompletionChunkChoice(index=out.index, text=out.delta_text, finish_reason=out.finish_reason, logprobs=lp)
        ]
