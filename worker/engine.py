"""The engine one worker group runs: admission with prefix reuse, continuous batching, sampling, outputs.

    engine = Engine(EngineConfig(model="demo"))
    outs = engine.generate([prompt_ids], SamplingParams(max_tokens=16, temperature=0.0), tenant="acme")

``add_request`` (of a ``Submit``) / ``step`` / ``abort`` are the incremental interface the Ray actor drives; every
``step`` returns one ``RequestOutput`` per request that advanced, with the step's new tokens and text.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass, field

import torch

from common import env
from common.checks import is_power_of_two
from common.defaults import DEFAULT_PIN_TTL_S
from common.events import EventSink, HeldKeys
from common.hashing import HASH_ALGOS, RootKeys, new_secret
from common.lora import AdapterRef
from common.model_config import ModelConfig, load_tokenizer, max_model_len
from common.outputs import FinishReason, RequestOutput
from common.protocol import Submit
from common.sampling import SamplingParams
from common.stats import EngineStats, PrefixCacheStats, TierStats
from worker.attention import TorchBackend, get_backend
from worker.distributed import send_plan, tp_size
from worker.kv_cache_manager import KVCacheManager
from worker.kv_tier_index import TierIndex
from worker.kv_tiers import KVTiersConfig
from worker.layers.linear import force_float32_path, pack_linear_weights, pick_float32_path
from worker.model_runner import ModelRunner
from worker.models.registry import resolve_model
from worker.output_processor import OutputProcessor
from worker.sampler import Sampler, SampleResult
from worker.scheduler import Scheduler
from worker.sequence import Sequence
from worker.structured import Grammars

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_MAX_ERROR_CHARS = 500
MAX_CHOICES = 128  # n of one request
_log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    """Engine settings. ``model`` is an HF folder or ``"demo"``. The KV cache holds ``num_blocks`` blocks if
    given, else as many as fit in ``kv_cache_bytes`` (CPU) or in ``gpu_memory_utilization`` of the GPU memory
    left after loading weights (CUDA). ``secret`` salts every tenant's root key: router and workers must share
    it (default: ``$KVGRID_SECRET``, else a random one per engine). ``step_timeout_s``: in a worker group, a
    step that runs longer (a hung collective, a stopped rank) fails the group."""

    model: str = "demo"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int = 512 * 2**20
    gpu_memory_utilization: float = 0.85
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    attention_backend: str = "auto"
    hash_algo: str = "xxh3_128"
    secret: bytes | str | None = None
    seed: int = 0
    max_pinned_tokens_per_tenant: int | None = None
    pinned_token_limits: dict[str, int] = field(default_factory=dict)  # per tenant, overrides the above
    max_pinned_fraction: float = 0.5  # of all blocks, over every tenant: pins never starve requests
    # Weights of the tenants' shares of the cache: eviction takes from the tenant holding the most for its weight,
    # and a listed tenant without a pin limit may pin its weighted part of ``max_pinned_fraction``.
    tenant_shares: dict[str, float] = field(default_factory=dict)
    step_timeout_s: float = 60.0
    # CUDA, one rank: replay decode steps from CUDA graphs captured at start-up (ignored on CPU).
    cuda_graphs: bool = True
    # CPU: intra-op threads of a decode-only step (one token per sequence); None = as many as every other step.
    # A decode step is small and the HTTP path streams its tokens meanwhile: with cores shared, fewer threads
    # for it wait less on each other (see ModelRunner.pick_threads).
    decode_threads: int | None = None
    # Host RAM and disk tiers under the KV cache, per rank (worker/kv_tiers.py; docs/caching.md). Off by default.
    kv_tiers: KVTiersConfig = field(default_factory=KVTiersConfig)
    # LoRA adapters (PEFT folders, ``Submit.adapter``): device slots, i.e. distinct adapters in one step (0: no
    # adapters served), their largest rank, and the evicted adapters kept in host memory before a re-read.
    max_loras: int = 8
    max_lora_rank: int = 64
    max_cpu_loras: int = 32
    lora_graphs: bool = False  # CUDA graphs for adapters' decode steps; slots allocated before the KV cache

    def __post_init__(self) -> None:
        if not is_power_of_two(self.block_size):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {self.hash_algo!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.decode_threads is not None and self.decode_threads < 1:
            raise ValueError(f"decode_threads must be >= 1, got {self.decode_threads}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s!r}")
        if self.max_loras < 0 or self.max_lora_rank < 1 or self.max_cpu_loras < 0:
            raise ValueError("max_loras and max_cpu_loras must be >= 0 and max_lora_rank >= 1")
        if isinstance(self.kv_tiers, dict):
            self.kv_tiers = KVTiersConfig(**self.kv_tiers)


def _pick_dtype(name: str, mcfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES[mcfg.torch_dtype] if mcfg.torch_dtype in ("float16", "bfloat16") else torch.bfloat16


def engine_secret(config: EngineConfig) -> bytes | str:
    """The secret that salts the tenants' root keys (and keys the KV tier files' MACs)."""
    return config.secret or env.secret() or new_secret()


def build_runner(config: EngineConfig, secret: bytes | str | None = None) -> ModelRunner:
    """Load this rank's shard of the model and allocate its KV cache and KV tiers (every rank of a group calls
    this)."""
    mcfg = ModelConfig.from_folder(resolve_model(config.model))
    dev = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(dev)
    dtype = _pick_dtype(config.dtype, mcfg, device)
    backend = get_backend(config.attention_backend, device.type)
    runner = ModelRunner(mcfg, device, dtype, config.block_size, backend)
    runner.decode_threads = config.decode_threads
    runner.enable_lora(config.max_loras, config.max_lora_rank, config.max_cpu_loras)  # (before packing)
    if runner.lora is not None and config.lora_graphs and config.cuda_graphs and device.type == "cuda":
        runner.lora.allocate()  # (before the KV cache takes what memory is left)
    runner.allocate_kv_cache(config.num_blocks, config.kv_cache_bytes, config.gpu_memory_utilization)
    runner.enable_kv_tiers(config.kv_tiers, secret if secret is not None else engine_secret(config))
    if device.type == "cpu" and dtype == torch.bfloat16:  # after the tiers' fingerprint, which reads the weights
        pack_linear_weights(runner.model)
    if device.type == "cpu" and dtype == torch.float32:
        path = pick_float32_path(runner.model)
        if path == "packed" and not pack_linear_weights(runner.model):
            path = force_float32_path("torch")  # a probe through a packed weight disagreed: trust F.linear only
        runner.linear_path = path
        _log.info("float32 linears: %s", path)
    if device.type == "cpu" and isinstance(backend, TorchBackend):  # build the decode kernel now, not in a step
        _log.info("CPU decode attention: %s", "in place (C kernel)" if backend.cpu_kernel() else "torch (gathered)")
    if config.cuda_graphs:
        runner.enable_cuda_graphs(config.max_num_seqs, max_model_len(mcfg, config.max_model_len))
    return runner


class Engine:
    def __init__(self, config: EngineConfig, event_sink: EventSink | None = None) -> None:
        self.config = config
        secret = engine_secret(config)
        self.runner = build_runner(config, secret)
        self.model_config = mcfg = self.runner.mcfg
        self.model_path = mcfg.path
        self.device, self.dtype = self.runner.device, self.runner.dtype
        self.max_model_len = max_model_len(mcfg, config.max_model_len)
        self.tokenizer = load_tokenizer(self.model_path)
        tiers = None
        if self.runner.tiers is not None:
            tiers = TierIndex(
                self.runner.tiers, self.runner.stage_kv, event_sink, config.tenant_shares, async_reads=tp_size() == 1
            )
            self.runner.defer_tier_writes = True  # queued at the end of step(), once its tokens are out
        self.kv = KVCacheManager(
            self.runner.num_blocks, config.block_size, config.hash_algo, event_sink, config.tenant_shares, tiers
        )
        if tiers is not None:
            tiers.rebuild_disk_index(event_sink)  # AllCleared, then what a surviving disk tier holds
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs, config.max_loras)
        self.sampler = Sampler(config.seed, Grammars(self.tokenizer, mcfg.vocab_size, mcfg.eos_token_ids))
        self.outputs = OutputProcessor(self.tokenizer, mcfg.eos_token_ids, self.max_model_len, config.block_size)
        # (tenant, adapter id) -> its root key (never sent to a client)
        self.root_key = RootKeys(secret, config.hash_algo)
        self._seqs: dict[str, Sequence] = {}
        # Explicit cache entries by their last block's key: (tenant, prompt tokens, deadline). What a draining
        # group hands over so another group can recompute and pin them.
        self._pin_entries: dict[bytes, tuple[str, list[int], float]] = {}
        self._ids = itertools.count()
        # n > 1: request id -> [n, choices not finished yet]; KV block copies the next step makes first.
        self._choices: dict[str, list[int]] = {}
        self._block_copies: list[tuple[int, int]] = []
        self._steps, self._step_s, self._step_cpu_s = 0, 0.0, 0.0  # steps that computed, their wall and CPU s

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    # -- requests ---------------------------------------------------------------------------------------------

    def add_request(self, req: Submit) -> str:
        """Queue a request (a ``Submit``, what a group's leader receives); returns its id (``req.request_id``, else
        a fresh ``req-N``). Raises ``ValueError`` (and changes nothing) if it is malformed or can never fit.

        ``n``: that many choices of one prompt, computed once: see ``_fork_choices``. Their outputs all carry
        the request's id, each with its ``index``.

        ``pin_tokens``: keep the full blocks of the first ``pin_tokens`` prompt tokens cached for ``pin_ttl_s``
        seconds after this request computes or hits them (an explicit cache entry; a hit refreshes it), within
        the tenant's ``max_pinned_tokens_per_tenant`` and ``max_pinned_fraction`` of the cache overall.

        ``adapter``: run under that LoRA adapter (a PEFT folder, read and checked here: ``AdapterError``, a
        ``ValueError``, names what is wrong). Its blocks are keyed under the tenant and the adapter."""
        params, tenant, n, pin_tokens, pin_ttl_s = req.params, req.tenant, req.n, req.pin_tokens, req.pin_ttl_s
        prompt = self.validate(req.prompt, params, pin_tokens, pin_ttl_s)
        request_id = req.request_id if req.request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}")
        adapter = self._check_adapter(req.adapter) if req.adapter is not None else None
        seq = Sequence(request_id, prompt, params, tenant, self.root_key(tenant, adapter.id if adapter else None))
        seq.adapter = adapter
        seq.pin_blocks, seq.pin_ttl_s = pin_tokens // self.config.block_size, pin_ttl_s
        if n > 1:
            seq.num_choices = n
            self._choices[request_id] = [n, n]
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def add_prompt(
        self,
        prompt_token_ids: Seq[int],
        params: SamplingParams | None = None,
        tenant: str = "default",
        request_id: str | None = None,
        pin_tokens: int = 0,
        pin_ttl_s: float = DEFAULT_PIN_TTL_S,
        n: int = 1,
    ) -> str:
        """``add_request`` of a ``Submit`` made of these (what tests and benchmarks that drive the engine
        directly call)."""
        prompt = prompt_token_ids if isinstance(prompt_token_ids, list) else self._check_prompt(prompt_token_ids)
        params = params if params is not None else SamplingParams()
        return self.add_request(Submit(prompt, params, tenant, request_id, pin_tokens, pin_ttl_s, n))

    def validate(
        self,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        pin_tokens: int = 0,
        pin_ttl_s: float = DEFAULT_PIN_TTL_S,
    ) -> list[int]:
        """Check a request without queuing it; returns the prompt as a list or raises ``ValueError``."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        prompt = self._check_prompt(prompt_token_ids)
        # The last token's K/V is never needed: it is sampled, not computed.
        longest = min(len(prompt) + params.max_tokens, self.max_model_len) - 1
        if -(-longest // self.config.block_size) > self.num_blocks:
            raise ValueError(
                f"request needs up to {longest} tokens of KV cache but the cache holds only "
                f"{self.num_blocks * self.config.block_size}; lower max_tokens or shorten the prompt"
            )
        if not 0 <= pin_tokens <= len(prompt) or pin_ttl_s <= 0:
            raise ValueError("pin_tokens must be within the prompt and pin_ttl_s positive")
        return prompt

    def _check_adapter(self, ref: AdapterRef) -> AdapterRef:
        if self.runner.lora is None or not isinstance(ref, AdapterRef):
            raise ValueError(f"this engine serves no LoRA adapters (max_loras 0), or {ref!r} is no AdapterRef")
        return self.runner.lora.check(ref)

    def _check_prompt(self, prompt_token_ids: Seq[int]) -> list[int]:
        if isinstance(prompt_token_ids, (str, bytes)):
            raise ValueError("the prompt must be a list of token ids (tokenize text first)")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        for t in prompt:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"token id {t!r} is outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens; the model's context is {self.max_model_len} "
                "(including at least one output token)"
            )
        return prompt

    def abort(self, request_id: str) -> bool:
        """Stop a request now (every choice of it); its blocks are released. Returns False if it is unknown or
        already done."""
        n = self._choices.pop(request_id, [1])[0]
        stopped = False
        for rid in [request_id, *(f"{request_id}/{c}" for c in range(1, n))]:
            seq = self._seqs.pop(rid, None)
            if seq is not None and not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)
                stopped = True
        return stopped

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- stepping ---------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch: schedule, compute, sample, and report every request that produced tokens. Counts the
        steps that computed something and their wall and thread CPU time (``stats``: a step's wall time well
        over its CPU time is a step that waited for a core)."""
        wall, cpu = time.perf_counter(), time.thread_time()
        outs = self._step()
        if outs is None:  # nothing to compute
            return []
        self._steps += 1
        self._step_s += time.perf_counter() - wall
        self._step_cpu_s += time.thread_time() - cpu
        return outs

    def _step(self) -> list[RequestOutput] | None:
        """``step``; None when it had no batch to compute."""
        now = time.monotonic()
        if self.kv.expire_pins(now) and self._pin_entries:
            self._prune_pin_entries(now)
        if self.kv.tiers is not None and self.scheduler.waiting:
            self.kv.stage(self.scheduler.waiting, self.config.max_num_seqs)  # disk -> host, before admission
        batch = self.scheduler.schedule()
        loads = self._assign_adapters(batch) if batch and self.runner.lora is not None else ()
        kv_ops = self.kv.take_tier_ops()
        if kv_ops is not None and not batch:  # copies queued outside a step (a fork's evictions): make them now
            if kv_ops:
                self.runner.run([], kv_ops=kv_ops)
            self._finish_tier_ops()
        if not batch:
            if self.has_unfinished():
                time.sleep(0.002)  # waiting for pinned blocks to expire: don't spin the caller's loop
            return None
        copies, self._block_copies = tuple(self._block_copies), []
        self.sampler.prefetch(batch)  # structured outputs' masks, computed while the model runs
        logits = self.runner.run(batch, copies, kv_ops, loads)
        done = [s for s, n in batch if s.num_computed_tokens + n == s.num_tokens]
        for seq, n in batch:
            self.scheduler.on_computed(seq, n)
            if seq.pin_blocks > seq.num_pinned_blocks and seq.num_registered_blocks > seq.num_pinned_blocks:
                self._pin(seq, now)
        if any(s.num_choices > 1 and s.num_output_tokens == 0 for s in done):
            done, logits = self._fork_choices(done, logits)
        results = self.sampler(logits, done) if done else []
        now = time.perf_counter()
        outputs = []
        for seq, res in zip(done, results):
            outputs.append(self._fail(seq, res) if isinstance(res, Exception) else self._advance(seq, res, now))
            if seq.is_finished:
                del self._seqs[seq.request_id]
                if seq.output_id in self._choices:
                    self._choice_finished(seq.output_id)
        if kv_ops is not None:  # the step's disk writes, then its host slots go back
            self._finish_tier_ops()
        return outputs

    def _assign_adapters(self, batch: list) -> tuple[tuple[str, str, int], ...]:
        """The step's adapter loads (LoraManager.assign); the batch sorted by slot, single tokens still first."""
        lora = self.runner.lora
        assert lora is not None
        wanted = {s.adapter.id: s.adapter.path for s, _ in batch if s.adapter is not None}
        if not wanted:
            return ()
        loads = lora.assign(wanted, self.scheduler.running_adapters())
        batch.sort(key=lambda item: (item[1] > 1, -1 if item[0].adapter is None else lora.slot_of(item[0].adapter.id)))
        return loads

    def _finish_tier_ops(self) -> None:
        assert self.runner.tiers is not None
        self.runner.tiers.write_pending()
        self.kv.tier_step_done(self.runner.tier_load_s)

    # -- n > 1: one prompt, n choices ---------------------------------------------------------------------------

    def _fork_choices(self, done: list[Sequence], logits: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
        """Requests with ``n > 1`` whose prompt this step finished computing fork into their choices here,
        before the first token is sampled: the prompt is computed once. Each choice shares the prompt's full
        blocks by reference count and gets its own copy of the last partial one (copied at the start of the
        next step, before anything writes to it: ``KVCacheManager.fork``), and samples its first token from the
        same logits. Returns the sequences to sample (each parent followed by its new choices) and their logits
        rows. A choice that finds no free block for its copy, or no room under ``max_num_seqs``, is queued as a
        request of its own instead: it reuses the cached full blocks and computes only the partial tail."""
        seqs: list[Sequence] = []
        rows: list[int] = []
        for i, seq in enumerate(done):
            seqs.append(seq)
            rows.append(i)
            if seq.num_choices == 1 or seq.num_output_tokens:
                continue
            for c in range(1, seq.num_choices):
                child = self._new_choice(seq, c)
                copies = self.kv.fork(seq, child) if self.scheduler.has_room else None
                if copies is None:
                    child.admitted, child.num_cached_tokens = True, seq.num_cached_tokens  # counted once
                    self.scheduler.add(child)
                    continue
                self._block_copies.extend(copies)
                self.scheduler.add_running(child)
                seqs.append(child)
                rows.append(i)
        if len(rows) > len(done):
            logits = logits[torch.tensor(rows, device=logits.device)]
        return seqs, logits

    def _new_choice(self, parent: Sequence, c: int) -> Sequence:
        """Choice ``c`` of ``parent``'s request: the same prompt and parameters, its own id in the engine and,
        when the request is seeded, its own seed (``seed + c``), so the choices are reproducible and differ."""
        params = parent.params
        if params.seed is not None:
            params = dataclasses.replace(params, seed=(params.seed + c) % 2**64)
        child = Sequence(f"{parent.request_id}/{c}", parent.prompt_token_ids, params, parent.tenant, parent.root_key)
        child.output_id, child.choice = parent.output_id, c
        child.adapter = parent.adapter
        child.arrival_time, child.scheduled_time = parent.arrival_time, parent.scheduled_time
        self._seqs[child.request_id] = child
        return child

    def _choice_finished(self, request_id: str) -> None:
        left = self._choices[request_id]
        left[1] -= 1
        if left[1] == 0:
            del self._choices[request_id]

    def _advance(self, seq: Sequence, res: SampleResult, now: float) -> RequestOutput:
        try:
            reason = self.outputs.append(seq, res, now)
            if res.done:  # the structured output is complete: nothing but EOS could follow
                reason = FinishReason.STOP
            if reason is not None:
                self.scheduler.finish(seq, reason)
            return self.outputs.output(seq)
        except Exception as exc:  # detokenizing or stop checking this one request failed
            return self._fail(seq, exc)

    def _fail(self, seq: Sequence, exc: Exception) -> RequestOutput:
        """Finish one request whose sampling, detokenizing or stop check raised; the rest of the batch carries on."""
        seq.error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
        _log.warning("request %s failed in the step: %s", seq.request_id, seq.error, exc_info=exc)
        self.scheduler.finish(seq, FinishReason.ERROR)
        seq.finish_reason = FinishReason.ERROR  # also when the failure came after a stop condition had finished it
        return self.outputs.failed(seq)

    def _pin(self, seq: Sequence, now: float) -> None:
        """Pin (or refresh) the request's registered blocks inside its pinned prefix."""
        upto = min(seq.pin_blocks, seq.num_registered_blocks)
        seq.num_pinned_blocks = self.kv.pin(
            seq.block_keys[:upto],
            now + seq.pin_ttl_s,
            seq.tenant,
            self.pin_limit_blocks(seq.tenant),
            int(self.config.max_pinned_fraction * self.kv.pin_capacity),
        )
        if seq.num_pinned_blocks < upto:  # a limit was reached: stop asking for this request
            seq.pin_blocks = seq.num_pinned_blocks
        n = seq.num_pinned_blocks
        if n:
            key = seq.block_keys[n - 1]
            old = self._pin_entries.get(key)
            until = max(now + seq.pin_ttl_s, old[2] if old else 0.0)
            self._pin_entries[key] = (seq.tenant, seq.token_ids[: n * self.config.block_size], until)

    def pin_limit_blocks(self, tenant: str) -> int | None:
        """The most blocks ``tenant`` may pin: its configured limit, else its weighted share of the pin budget
        (so no tenant's pins can use up the budget of the others), else only the overall cap."""
        c = self.config
        limit = c.pinned_token_limits.get(tenant, c.max_pinned_tokens_per_tenant)
        if limit is not None:
            return limit // c.block_size
        if tenant in c.tenant_shares:
            budget = c.max_pinned_fraction * self.kv.pin_capacity
            return int(budget * c.tenant_shares[tenant] / sum(c.tenant_shares.values()))
        return None

    def pinned_entries(self) -> list[tuple[str, list[int], float]]:
        """The explicit cache entries still pinned here: (tenant, prompt tokens, seconds left)."""
        now = time.monotonic()
        self._prune_pin_entries(now)
        return [(t, list(toks), until - now) for t, toks, until in self._pin_entries.values()]

    def _prune_pin_entries(self, now: float) -> None:
        for key in [k for k, (_, _, until) in self._pin_entries.items() if until <= now]:
            del self._pin_entries[key]

    # -- convenience ------------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        tenant: str = "default",
    ) -> list[RequestOutput]:
        """Run ``prompts`` as one batch to completion; results in the order given. Every prompt is checked
        before any is queued, so a bad one raises ``ValueError`` without side effects."""
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        for p, sp in zip(prompts, params):
            self.validate(p, sp)
        ids = [self.add_prompt(p, sp, tenant) for p, sp in zip(prompts, params)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(
        self, prompt: Seq[int], params: SamplingParams | None = None, tenant: str = "default"
    ) -> Iterator[RequestOutput]:
        """Run one request, yielding its output after every step that advanced it (other requests advance too)."""
        rid = self.add_prompt(prompt, params, tenant)
        while True:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return

    def stats(self) -> EngineStats:
        usage = self.kv.usage()
        sched = self.scheduler
        queued = sum(
            s.num_tokens - s.num_computed_tokens
            for s in [*sched.waiting, *sched.running]
            if s.num_tokens - s.num_computed_tokens > 1
        )
        return EngineStats(
            running=len(sched.running),
            waiting=len(sched.waiting),
            queued_prefill_tokens=queued,
            blocks_used=usage.used,
            blocks_cached=usage.cached,
            blocks_free=usage.free,
            blocks_pinned=usage.pinned,
            num_preemptions=sched.num_preemptions,
            computed_tokens=sched.num_computed_tokens,
            prefix_cache={t: PrefixCacheStats(**vars(s)) for t, s in self.kv.stats.items()},
            **_tier_fields(self.kv.tier_stats()),
            steps=self._steps,
            step_seconds=self._step_s,
            step_cpu_seconds=self._step_cpu_s,
            lora_adapters=self.runner.lora.resident() if self.runner.lora is not None else [],
        )

    def close(self, max_s: float = 5.0) -> None:
        """Write the GPU pool's cached blocks that the disk tier lacks down to it (for about ``max_s`` seconds at
        most), and wait for the disk writes, so that a restart on the same ``disk_path`` and secret finds them.
        Called once, when the engine stops; a no-op without tiers."""
        tiers = self.kv.tiers
        if tiers is None:
            return
        deadline = time.monotonic() + max_s
        if tiers.disk is not None:
            for _ in self.kv.write_down():  # a round of copies, as many as host RAM has slots for
                ops = self.kv.take_tier_ops()
                if ops:
                    self.runner.run([], kv_ops=ops)
                self.kv.tier_step_done(0.0)
                tiers.store.flush()
                if time.monotonic() > deadline:
                    break
        tiers.close()
        tiers.store.close()  # waits for the queued writes

    def held_keys(self) -> HeldKeys:
        """Every key the pool holds, tier by tier (a KV event snapshot)."""
        return self.kv.held_keys()

    def stop_followers(self) -> None:
        """Tell the group's other ranks to stop following (they return from ``follow``); a no-op alone."""
        send_plan(None)

    def forget_tenant(self, tenant: str) -> tuple[int, int]:
        """A deleted tenant: its pins released, its unused cached blocks forgotten; (pins, blocks)."""
        return self.kv.forget_tenant(tenant)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (only while idle); publishes ``AllCleared``."""
        return self.kv.reset()


def _tier_fields(tiers: dict[str, TierStats]) -> dict:
    host, disk = tiers.get("host", TierStats()), tiers.get("disk", TierStats())
    return {
        "kv_tiers": tiers,
        "host_blocks": host.blocks,
        "disk_blocks": disk.blocks,
        "host_hit_blocks": host.hits,
        "disk_hit_blocks": disk.hits,
        "tier_load_bytes": host.load_bytes + disk.load_bytes,
        "tier_load_seconds": host.load_s + disk.load_s,
    }
