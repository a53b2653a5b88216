"""A request's prompt and parameters (``Prompts``): chat templates and tokenizing, done in a pool of threads shared
fairly between tenants (``CpuPool``) unless the text is short, a cheap 413 before tokenizing a text too long by its
characters alone, the prefix of a referenced cached content, and ``SamplingParams`` with their errors in the
calling API's format."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from common.model_config import load_tokenizer
from common.sampling import SamplingParams, StructuredOutput
from router.gateway.chat import ChatPrompt, ChatTemplateError, encode_chat
from router.gateway.errors import err
from router.gateway.store import CachedContentStore
from router.gateway.tenants import Tenant
from router.gateway.tracing import current_trace, traced

T = TypeVar("T")

# CPU-heavy work of a request (tokenizing, chat templates, grammar checks, building and serialising a large answer)
# runs in a pool of this many threads, never on the event loop; a tenant occupies at most CPU_SHARE of them, so
# another tenant finds one. Tokenizing happens in Rust without the GIL, so the loop stays free meanwhile.
CPU_WORKERS = max(2, min(4, os.cpu_count() or 2))
CPU_SHARE = max(1, CPU_WORKERS // 2)
# Shorter texts are tokenized on the loop: a chat template and tokenizing take a millisecond or two there, a queue
# behind other tenants' jobs in the pool could take longer.
INLINE_CHARS = 1024
# A token covers at most the characters of its longest vocabulary entry; a normalizer may compose up to this many
# characters into one (NFC: a Hangul syllable, a letter and its accents) before that.
NORMALIZED_CHARS = 4


def _chars_per_token(tokenizer) -> int:
    """The most characters of a text that one token can cover: its longest vocabulary entry (a byte-level entry's
    characters are bytes, at least as many as the text's characters), times ``NORMALIZED_CHARS`` when a normalizer
    may first compose several characters into one."""
    longest = max((len(piece) for piece in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    plain = backend is not None and backend.normalizer is None
    return max(1, longest) * (1 if plain else NORMALIZED_CHARS)


class CpuPool:
    """The threads that do a replica's CPU-heavy request work off its event loop, shared fairly: a tenant runs at
    most ``per_tenant`` jobs at once (its further jobs wait for one of its own to end), so with ``per_tenant`` below
    ``workers`` no tenant alone occupies every worker, and the queue in front of them holds at most ``per_tenant``
    jobs of each tenant. A job counts against its tenant until its thread is done with it, also when the request
    that waited for it has gone."""

    def __init__(self, workers: int, per_tenant: int, initializer: Callable[[], None] | None = None) -> None:
        self.workers, self.per_tenant = workers, per_tenant
        self._executor = ThreadPoolExecutor(workers, "kvgrid-cpu", initializer=initializer)
        self._shares: dict[str, asyncio.Semaphore] = {}

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        share = self._shares.get(tenant)
        if share is None:
            share = self._shares[tenant] = asyncio.Semaphore(self.per_tenant)
        await share.acquire()
        loop = asyncio.get_running_loop()
        try:
            job = self._executor.submit(fn, *args)
        except BaseException:
            share.release()
            raise

        def done(_: object) -> None:
            try:
                loop.call_soon_threadsafe(share.release)
            except RuntimeError:  # the loop has closed: nothing waits for the share any more
                pass

        job.add_done_callback(done)
        return await asyncio.wrap_future(job)

    def close(self) -> None:
        """Drop the jobs not started; the running ones end on their own (the threads are not waited for)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


class Prompts:
    """One replica's way from request text to token ids and parameters. ``max_model_len``: the context the engine
    enforces; ``contents``: each tenant's cached contents (their token ids prefix a request that names one)."""

    def __init__(self, model_path: str, max_model_len: int, contents: dict[str, CachedContentStore]) -> None:
        # The event loop's tokenizer: no other thread uses it (a transformers tokenizer keeps per-call settings on
        # itself, such as whether special-token text is matched); each thread of ``cpu`` loads its own.
        self.tokenizer = load_tokenizer(model_path)
        self._local = threading.local()
        self.cpu = CpuPool(CPU_WORKERS, CPU_SHARE, lambda: self._load_thread_tokenizer(model_path))
        self.chars_per_token = _chars_per_token(self.tokenizer)
        # Token ids a prompt may hold: below this. Read once: len() of a transformers tokenizer rebuilds its whole
        # vocabulary.
        self.vocab_size = len(self.tokenizer)
        self.max_model_len = max_model_len
        self.contents = contents

    def close(self) -> None:
        self.cpu.close()

    def check_chars(self, t: Tenant, chars: int, api: str) -> None:
        """413 for a prompt that ``chars`` characters of its text make longer than ``check_size`` takes, before it is
        tokenized: no token covers more than ``chars_per_token`` of them, so it has more tokens than that."""
        lim = t.config.limits
        tokens = min(n for n in (self.max_model_len - 1, lim.max_prompt_tokens, lim.tokens_per_min) if n is not None)
        if chars > tokens * self.chars_per_token:
            raise err(
                413,
                f"the prompt has {chars} characters: more than {tokens} tokens hold (one holds at most "
                f"{self.chars_per_token} characters here; the context is {self.max_model_len} tokens)",
                api,
            )

    def _load_thread_tokenizer(self, model_path: str) -> None:
        self._local.tokenizer = load_tokenizer(model_path)

    def thread_tokenizer(self):
        """The tokenizer of the calling thread: a ``cpu`` worker's own, else the event loop's."""
        tokenizer = getattr(self._local, "tokenizer", None)
        return self.tokenizer if tokenizer is None else tokenizer

    async def compute(self, t: Tenant, fn: Callable[..., T], *args: Any, inline: bool = False) -> T:
        """``fn(*args)`` in the tenant's share of the worker pool (``CpuPool``); on the loop when ``inline`` (work too
        small to be worth a thread)."""
        return fn(*args) if inline else await self.cpu.run(t.name, fn, *args)

    async def encode_text(self, t: Tenant, text: str, api: str) -> list[int]:
        """A completion's text prompt as token ids (special-token text matched: it is the caller's own template);
        413 at once for one too long by its characters alone."""
        self.check_chars(t, len(text), api)
        with traced("tokenize") as span:
            ids = await self.compute(t, self._encode_text, text, inline=len(text) <= INLINE_CHARS)
            if span is not None:
                span.set_attribute("kvgrid.prompt_tokens", len(ids))
        return ids

    def _encode_text(self, text: str) -> list[int]:
        return self.thread_tokenizer().encode(text, add_special_tokens=False)

    async def chat(
        self,
        t: Tenant,
        messages: list[dict[str, Any]],
        api: str,
        generation: bool = True,
        tools: list[dict] | None = None,
    ) -> ChatPrompt:
        """The chat template applied to ``messages`` (every API's one way to a chat prompt), with ``tools`` (function
        definitions, router/gateway/tools.py); their texts never become special tokens (router/gateway/chat.py).
        Messages too long for the tenant by their characters alone get 413 before the template; the rest is
        rendered and tokenized in the worker pool unless it is short."""
        chars = sum(len(m["content"].strip()) for m in messages if isinstance(m.get("content"), str))
        self.check_chars(t, chars, api)
        inline = chars <= INLINE_CHARS and not tools and not any(m.get("tool_calls") for m in messages)
        rt = current_trace()
        marks: list[int] | None = None if rt is None else []  # traced: when templating and tokenizing ran
        prompt: ChatPrompt | None = None
        try:
            prompt = await self.compute(t, self._encode_chat, messages, generation, tools, marks, inline=inline)
        except ChatTemplateError as exc:
            raise err(400, f"messages: {exc}", api) from None
        finally:
            if rt is not None and marks:
                rt.chat_spans(marks, None if prompt is None else len(prompt.token_ids))
        return prompt

    def _encode_chat(
        self,
        messages: list[dict[str, Any]],
        generation: bool,
        tools: list[dict] | None = None,
        marks: list[int] | None = None,
    ) -> ChatPrompt:
        if marks is not None:
            marks.append(time.time_ns())
        prompt = encode_chat(
            self.thread_tokenizer(), messages, add_generation_prompt=generation, tools=tools, marks=marks
        )
        if marks is not None:
            marks.append(time.time_ns())
        return prompt

    async def cached_prefix(self, t: Tenant, cid: str | None, api: str) -> tuple[list[int], float]:
        """Token ids and remaining TTL of a referenced cached content object."""
        if cid is None:
            return [], 0.0
        name = cid if cid.startswith("cachedContents/") else f"cachedContents/{cid}"
        cc = await self.contents[t.name].get(t.name, name)
        if cc is None:
            raise err(404, f"cached content {cid!r} not found", api)
        return cc.token_ids, max(1.0, cc.expires - time.time())

    def params(
        self,
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop: list[str] | None,
        seed: int | None,
        api: str,
        top_k: int = 0,
        ignore_eos: bool = False,
        structured_output: StructuredOutput | None = None,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        stop_token_ids: list[int] | None = None,
    ) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                min_p=min_p,
                repetition_penalty=repetition_penalty,
                stop=stop or [],
                stop_token_ids=stop_token_ids or [],
                seed=seed,
                ignore_eos=ignore_eos,
                structured_output=structured_output,
            )
        except ValueError as exc:
            raise err(400, str(exc), api) from None
