"""``kvgrid bench serve``: an HTTP load generator for any OpenAI-compatible server (kvgrid, vLLM, ...).

Workloads:

- ``random``: ``num_requests`` prompts of ``input_len`` tokens whose first ``round(input_len * prefix_ratio)``
  tokens are the same for every request (a shared system prompt), the rest unique per request.
- ``multi-turn``: ``conversations`` conversations of ``turns`` turns, sent one turn after the other; a turn's
  prompt is the previous prompt + the previous answer + ``turn_len`` new user tokens.
- ``trace``: a Mooncake-format trace (``tests/data/README.md``): each hash id is one block of
  ``trace_block_size`` tokens, equal ids give equal blocks, and requests are sent at their timestamps times
  ``time_scale``.

Prompts are token ids (``/completions``), or words (``text``: ``/completions`` with a string; ``chat``:
``/chat/completions``) where each synthetic token id becomes one word, so shared token blocks are shared text.
Every request streams with ``stream_options.include_usage``; TTFT is the time to the first non-empty text chunk,
the inter-token latency the time between consecutive text chunks, and the cached share is the sum of
``usage.prompt_tokens_details.cached_tokens`` over the sum of ``usage.prompt_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from tqdm import tqdm

from router.sim import proc_cpu
from router.sim.trace import MOONCAKE_BLOCK, TraceEntry, read_mooncake

_log = logging.getLogger(__name__)

PROMPT_FORMATS = ("tokens", "text", "chat")
WORKLOADS = ("random", "multi-turn", "trace")
FALLBACK_VOCAB = 1000

# Words for text prompts: consonant-vowel pairs, so that every synthetic id has a short, distinct word.
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


# -- inputs ------------------------------------------------------------------------------------------------------


class TokenSource:
    """Deterministic synthetic token ids below ``vocab_size``: one stream per name, one block per hash id."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size, self.seed = vocab_size, seed
        self._blocks: dict[tuple[int, int], list[int]] = {}

    def tokens(self, name: str, n: int) -> list[int]:
        rng = random.Random(f"{self.seed}/{name}")  # string seeds are hashed: stable across runs and machines
        return [rng.randrange(self.vocab_size) for _ in range(n)]

    def block(self, hash_id: int, size: int) -> list[int]:
        key = (hash_id, size)
        if key not in self._blocks:  # hash ids repeat across a trace: build each block once
            self._blocks[key] = self.tokens(f"block/{hash_id}", size)
        return self._blocks[key]

    def trace_prompt(self, entry: TraceEntry, block_size: int) -> list[int]:
        """The entry's prompt with ``block_size`` tokens per hash id (its length scaled from 512 per id)."""
        length = max(1, math.ceil(entry.input_length * block_size / MOONCAKE_BLOCK))
        ids = [tok for h in entry.hash_ids for tok in self.block(h, block_size)]
        return ids[:length]


def words(ids: Iterable[int]) -> str:
    """Text for synthetic token ids: one word per id, each after a space so that word boundaries stay put."""
    n = len(_SYLLABLES)
    return "".join(f" {_SYLLABLES[i % n]}{_SYLLABLES[i // n % n]}" for i in ids)


@dataclass
class Prompt:
    """One request's prompt in the synthetic token ids, and how it goes on the wire."""

    ids: list[int]
    output_len: int
    fmt: str
    history: list[dict[str, str]] = field(default_factory=list)  # chat: the turns before the last user message
    asked: int = 0  # chat: how many of ``ids`` the history holds

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            # Asks for exactly max_tokens where the server supports it (vLLM); others ignore unknown fields.
            "ignore_eos": True,
        }
        if self.fmt == "chat":
            body["messages"] = [*self.history, {"role": "user", "content": words(self.ids[self.asked :])}]
        else:
            body["prompt"] = self.ids if self.fmt == "tokens" else words(self.ids)
        return body

    def follow_up(self, answer_text: str, answer_tokens: int, user_ids: list[int], answer_ids: list[int]) -> Prompt:
        """The next turn: this prompt, the answer, then ``user_ids``.

        The OpenAI API does not return the answer's token ids, so for token and text prompts ``answer_ids`` (as
        many conversation-specific ids as the answer had tokens) stand in for it: the previous prompt is then
        reusable from the cache, the answer is not. Chat sends the exact answer text as the assistant turn.
        """
        if self.fmt == "chat":
            history = [
                *self.history,
                {"role": "user", "content": words(self.ids[self.asked :])},
                {"role": "assistant", "content": answer_text},
            ]
            return Prompt(self.ids + user_ids, self.output_len, self.fmt, history, len(self.ids))
        return Prompt(self.ids + answer_ids[:answer_tokens] + user_ids, self.output_len, self.fmt)


def random_prompts(
    src: TokenSource, n: int, input_len: int, prefix_ratio: float, output_len: int, fmt: str, tag: str = "req"
) -> list[Prompt]:
    """``n`` prompts sharing their first ``round(input_len * prefix_ratio)`` tokens."""
    shared = round(input_len * prefix_ratio)
    prefix = src.tokens("prefix", shared)
    return [Prompt(prefix + src.tokens(f"{tag}/{i}", input_len - shared), output_len, fmt) for i in range(n)]


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of ``n`` requests arriving at ``rate`` per second; 0 = all at once."""
    if rate <= 0:
        return [0.0] * n
    rng, t, out = random.Random(f"{seed}/arrivals"), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# -- results -----------------------------------------------------------------------------------------------------


@dataclass
class Result:
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between order statistics; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarise(results: list[Result], duration_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    ttft = [(r.chunk_times[0] - r.start) * 1e3 for r in ok if r.chunk_times]
    itl = [(b - a) * 1e3 for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    e2e = [(r.end - r.start) * 1e3 for r in ok]
    prompt, cached, output = (
        sum(getattr(r, f) for r in ok) for f in ("prompt_tokens", "cached_tokens", "output_tokens")
    )

    def pcts(values: list[float], qs: tuple[int, ...]) -> dict[str, float | None]:
        return {f"p{q}": percentile(values, q) for q in qs}

    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": cached / prompt if prompt else 0.0,
        "output_tokens": output,
        "output_tokens_per_s": output / duration_s if duration_s > 0 else 0.0,
        "requests_per_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": pcts(ttft, (50, 90, 99)),
        "itl_ms": pcts(itl, (50, 99)),
        "e2e_ms": pcts(e2e, (50, 99)),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def format_summary(s: dict[str, Any]) -> str:
    def ms(d: dict[str, float | None]) -> str:
        return "  ".join(f"{k} {'-' if v is None else f'{v:.1f}'}" for k, v in d.items())

    lines = [
        f"{s['workload']} against {s['base_url']} ({s['model']}, {s['prompt_format']} prompts)",
        f"  requests      {s['completed']} completed, {s['failed']} failed in {s['duration_s']:.2f} s "
        f"({s['requests_per_s']:.2f} req/s)",
        f"  TTFT ms       {ms(s['ttft_ms'])}",
        f"  ITL ms        {ms(s['itl_ms'])}",
        f"  E2E ms        {ms(s['e2e_ms'])}",
        f"  output        {s['output_tokens']} tokens, {s['output_tokens_per_s']:.1f} tokens/s",
        f"  prompt        {s['prompt_tokens']} tokens, {s['cached_share']:.1%} cached",
    ]
    if "cpu_ms_per_1000_tokens" in s:
        lines.append("  CPU ms per 1000 output tokens, per process on this machine:")
        lines += [f"    {ms_:8.1f}  {name}" for name, ms_ in s["cpu_ms_per_1000_tokens"].items()]
    lines += [f"  error: {e}" for e in s["errors"]]
    return "\n".join(lines)


# -- sending -----------------------------------------------------------------------------------------------------


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Result:
    """One streamed request; a failure is recorded in the result, never raised."""
    chat = "messages" in body
    res = Result(start=time.perf_counter())
    parts: list[str] = []
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                text = (await r.read()).decode(errors="replace")
                res.error = f"HTTP {r.status}: {text[:200]}"
                return res
            async for line in _lines(r.content):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = f"stream error: {json.dumps(event['error'])[:200]}"
                    return res
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        res.chunk_times.append(time.perf_counter())
                        parts.append(piece)
                usage = event.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens") or 0
                    res.output_tokens = usage.get("completion_tokens") or 0
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: a body that is not JSON
        res.error = f"{type(exc).__name__}: {exc}"[:200]
        return res
    res.end = time.perf_counter()
    res.text = "".join(parts)
    if not res.output_tokens:  # a server without usage in streams: count the text chunks
        res.output_tokens = len(res.chunk_times)
    return res


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The body's lines as they arrive, of any length (aiohttp's own line reader raises ``LineTooLong`` past its
    buffer's high-water mark)."""
    pending: list[bytes] = []  # the unfinished line's pieces: joined once, when its newline comes
    async for piece in content.iter_any():
        if b"\n" not in piece:
            pending.append(piece)
            continue
        first, *lines, last = piece.split(b"\n")
        pending.append(first)
        yield b"".join(pending)
        for line in lines:
            yield line
        pending = [last]
    if any(pending):
        yield b"".join(pending)


@dataclass
class Job:
    """Something to send at ``at`` seconds: one prompt, or a conversation whose later turns follow the answers."""

    at: float
    prompt: Prompt  # the first (or only) turn
    follow_ups: int = 0
    user_ids: Callable[[int], list[int]] | None = None  # turn number -> its new user tokens
    answer_ids: Callable[[int], list[int]] | None = None  # turn number -> stand-in answer tokens

    def __post_init__(self) -> None:
        if self.follow_ups and (self.user_ids is None or self.answer_ids is None):
            raise ValueError("a job with follow-up turns needs user_ids and answer_ids")


async def run_jobs(
    base_url: str,
    api_key: str | None,
    model: str,
    jobs: list[Job],
    concurrency: int | None,
    timeout_s: float,
    progress: Callable[[], None],
) -> tuple[list[Result], float]:
    """Send every job (at most ``concurrency`` at once); the results in completion order and the wall time."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    results: list[Result] = []
    # aiohttp rather than httpx: with tens of streams httpx's pure-Python HTTP/1.1 stack uses a good part of a core,
    # which on a small machine is taken from the server measured.
    connector = aiohttp.TCPConnector(limit=concurrency or 0)  # 0: no limit (--request-rate without --concurrency)
    timeout = aiohttp.ClientTimeout(sock_connect=timeout_s, sock_read=timeout_s)  # as httpx's: per wait, not in all
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as client:
        t0 = time.perf_counter()

        async def one(job: Job) -> None:
            await asyncio.sleep(max(0.0, t0 + job.at - time.perf_counter()))
            if gate:
                await gate.acquire()
            try:
                prompt = job.prompt
                for turn in range(job.follow_ups + 1):
                    url = base_url + ("/chat/completions" if prompt.fmt == "chat" else "/completions")
                    res = await send(client, url, prompt.body(model))
                    results.append(res)
                    progress()
                    if res.error is not None or turn == job.follow_ups:
                        break  # a failed turn ends its conversation: the next prompt would need its answer
                    assert job.user_ids is not None and job.answer_ids is not None  # Job checks: it has follow-ups
                    prompt = prompt.follow_up(
                        res.text, res.output_tokens, job.user_ids(turn + 1), job.answer_ids(turn + 1)
                    )
            finally:
                if gate:
                    gate.release()

        await asyncio.gather(*(one(j) for j in jobs))
        return results, time.perf_counter() - t0


# -- the command -------------------------------------------------------------------------------------------------


def _get_models(base_url: str, api_key: str | None, timeout_s: float) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url + "/models"
    try:
        r = httpx.get(url, headers=headers, timeout=min(timeout_s, 30.0))
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {url} (--base-url): {exc}") from None
    if r.status_code in (401, 403):
        raise ValueError(f"{r.status_code} from GET {url}: check --api-key")
    if r.status_code != 200:
        raise ValueError(f"{r.status_code} from GET {url} (--base-url should end in /v1): {r.text[:200]}")
    return r.json().get("data") or []


def default_vocab(model: str) -> int | None:
    """The vocabulary size of ``model`` where its name leads to a local model folder (vLLM names a model by the
    path it was given; ``demo`` is kvgrid's demo model), else None."""
    if model == "demo" or model.startswith("demo:"):
        from worker.models.registry import resolve_model

        folder = resolve_model(model)
    else:
        folder = Path(model)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return int(vocab) if vocab else None


def _check(args: Any) -> None:
    """Bad input exits with code 2 before any request; each message names its flag."""
    positive = [
        ("--input-len", args.input_len),
        ("--num-requests", args.num_requests),
        ("--turns", args.turns),
        ("--conversations", args.conversations),
        ("--trace-block-size", args.trace_block_size),
        ("--timeout", args.timeout),
    ]
    optional_positive = [
        ("--output-len", args.output_len),
        ("--concurrency", args.concurrency),
        ("--max-requests", args.max_requests),
    ]
    for flag, value in positive + [(f, v) for f, v in optional_positive if v is not None]:
        if value <= 0:
            raise ValueError(f"{flag} must be > 0, not {value}")
    if args.turn_len < 0 or args.warmup < 0:
        raise ValueError("--turn-len and --warmup must be >= 0")
    if not 0.0 <= args.prefix_ratio <= 1.0:
        raise ValueError(f"--prefix-ratio must be in [0, 1], not {args.prefix_ratio}")
    if args.request_rate < 0 or not math.isfinite(args.request_rate):
        raise ValueError(f"--request-rate must be a finite number >= 0, not {args.request_rate}")
    if args.time_scale < 0 or not math.isfinite(args.time_scale):
        raise ValueError(f"--time-scale must be a finite number >= 0, not {args.time_scale}")
    if args.vocab_size is not None and args.vocab_size < 2:
        raise ValueError(f"--vocab-size must be >= 2, not {args.vocab_size}")
    if not args.base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must be an http:// or https:// URL, not {args.base_url!r}")
    if (args.workload == "trace") != (args.trace is not None):
        raise ValueError("--trace FILE is required by --workload trace and only used by it")


def _jobs(args: Any, src: TokenSource, output_len: int, trace: list[TraceEntry]) -> tuple[list[Job], list[Job]]:
    """The warm-up jobs and the measured jobs of the chosen workload."""
    fmt = args.prompt_format
    warm = [
        Job(0.0, p)
        for p in random_prompts(src, args.warmup, args.input_len, args.prefix_ratio, output_len, fmt, tag="warmup")
    ]
    if args.workload == "random":
        prompts = random_prompts(src, args.num_requests, args.input_len, args.prefix_ratio, output_len, fmt)
        at = poisson_offsets(len(prompts), args.request_rate, args.seed)
        return warm, [Job(t, p) for t, p in zip(at, prompts)]
    if args.workload == "multi-turn":
        firsts = random_prompts(src, args.conversations, args.input_len, args.prefix_ratio, output_len, fmt, tag="conv")
        at = poisson_offsets(len(firsts), args.request_rate, args.seed)

        def turn_tokens(c: int, role: str, n: int) -> Callable[[int], list[int]]:
            """Turn number -> ``n`` tokens for ``role``'s part of conversation ``c`` in that turn."""
            return lambda turn: src.tokens(f"conv/{c}/{role}/{turn}", n)

        return warm, [
            Job(
                t,
                p,
                args.turns - 1,
                user_ids=turn_tokens(c, "user", args.turn_len),
                answer_ids=turn_tokens(c, "answer", output_len),
            )
            for c, (t, p) in enumerate(zip(at, firsts))
        ]
    start = trace[0].timestamp_s  # a cut of a longer trace starts where it was cut
    return warm, [
        Job(
            (e.timestamp_s - start) * args.time_scale,
            Prompt(src.trace_prompt(e, args.trace_block_size), args.output_len or e.output_length, fmt),
        )
        for e in trace
    ]


def run(args: Any) -> int:
    _check(args)
    trace = read_mooncake(args.trace, args.max_requests) if args.trace else []  # bad input fails before any request
    base_url = args.base_url.rstrip("/")
    model = args.model
    if model is None:
        models = _get_models(base_url, args.api_key, args.timeout)
        if not models:
            raise ValueError(f"GET {base_url}/models lists no model: pass --model")
        model = models[0]["id"]
    vocab = args.vocab_size or default_vocab(model)
    if vocab is None:
        _log.warning("vocabulary of %r unknown: token ids below %d (set --vocab-size)", model, FALLBACK_VOCAB)
        vocab = FALLBACK_VOCAB
    src = TokenSource(vocab, args.seed)
    output_len = args.output_len or 128
    warm, jobs = _jobs(args, src, output_len, trace)
    # Closed-loop workloads default to one request at a time; paced ones (a rate, a trace) to no cap.
    paced = args.workload == "trace" or args.request_rate > 0
    concurrency = args.concurrency or (None if paced else 1)

    if warm:
        warm_results, _ = asyncio.run(run_jobs(base_url, args.api_key, model, warm, 1, args.timeout, lambda: None))
        failed = [r.error for r in warm_results if r.error]
        if failed:
            raise ValueError(f"a warm-up request failed: {failed[0]}")
    total = sum(j.follow_ups + 1 for j in jobs)
    if args.cpu_per_process:
        cpu_before, own_before = proc_cpu.snapshot(), proc_cpu.own_cpu_s()
    with tqdm(total=total, desc="requests", unit="req", file=sys.stderr, disable=None) as bar:
        results, duration = asyncio.run(
            run_jobs(base_url, args.api_key, model, jobs, concurrency, args.timeout, bar.update)
        )
    summary = {
        "workload": args.workload,
        "base_url": base_url,
        "model": model,
        "prompt_format": args.prompt_format,
        "vocab_size": vocab,
        "concurrency": concurrency,
        **summarise(results, duration),
    }
    if args.cpu_per_process:
        used = proc_cpu.per_process(cpu_before, proc_cpu.snapshot(), skip_pid=os.getpid())
        own = proc_cpu.own_cpu_s() - own_before
        summary["cpu_ms_per_1000_tokens"] = proc_cpu.table(used, own, summary["output_tokens"])
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    if summary["failed"]:
        print(f"kvgrid: {summary['failed']} of {summary['requests']} requests failed", file=sys.stderr)
        return 1
    return 0


def add_arguments(p: Any) -> None:
    """The ``kvgrid bench serve`` flags."""
    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000/v1",
        help="the OpenAI base URL, ending in /v1 (kvgrid: http://HOST:PORT/TENANT/v1)",
    )
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    p.add_argument("--model", default=None, help="default: the first model of GET /v1/models")
    p.add_argument("--workload", default="random", choices=WORKLOADS)
    p.add_argument(
        "--prompt-format",
        default="tokens",
        choices=PROMPT_FORMATS,
        help="token ids or text to /v1/completions, or chat messages to /v1/chat/completions",
    )
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens (random; multi-turn: first turn)")
    p.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="max tokens per request (default 128; a trace's own lengths unless given)",
    )
    p.add_argument(
        "--prefix-ratio",
        type=float,
        default=0.0,
        help="share of --input-len that every prompt has in common (random, multi-turn)",
    )
    p.add_argument("--num-requests", type=int, default=64, help="requests (random)")
    p.add_argument("--conversations", type=int, default=8, help="conversations (multi-turn)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (multi-turn)")
    p.add_argument("--turn-len", type=int, default=64, help="new user tokens per later turn (multi-turn)")
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="most requests (multi-turn: conversations) in flight; default 1, no cap for a --request-rate or a trace",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=0.0,
        help="Poisson arrivals per second (random, multi-turn); 0: as fast as --concurrency allows",
    )
    p.add_argument("--trace", default=None, help="Mooncake-format JSONL trace (--workload trace)")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiplies the trace's timestamps (0.1: ten times faster; 0: all at once)",
    )
    p.add_argument("--max-requests", type=int, default=None, help="replay only the trace's first N requests")
    p.add_argument(
        "--trace-block-size",
        type=int,
        default=MOONCAKE_BLOCK,
        help="prompt tokens per hash id (lengths scale with it; default 512 as in the trace)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"token ids are below it (default: from the model folder if found, else {FALLBACK_VOCAB})",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="random prompts (--input-len, --prefix-ratio: they share the prefix) sent first, one at a "
        "time, not measured",
    )
    p.add_argument("--seed", type=int, default=0, help="prompts and arrivals; change it to avoid earlier caches")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds a request may wait on the server: to connect, or between two reads of its stream",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument(
        "--cpu-per-process",
        action="store_true",
        help="also report the CPU time every process on this machine used during the run, in ms per 1000 output "
        "tokens (Linux /proc; for a server on this machine)",
    )
