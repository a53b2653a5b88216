"""Continuous batching: each step mixes decodes with (chunked) prefills under a token budget.

Decodes go first, then unfinished prefills of running requests, then new admissions in arrival order. When
blocks run out, the youngest running request is preempted: its blocks are released (they stay cached, so
its own recompute usually hits them) and it goes back to the front of the queue.

At most ``max_loras`` distinct LoRA adapters run at once (the engine's adapter slots): a waiting request whose
adapter would be one more waits, and from then on the step admits no request of another adapter, so the
running ones drain and free a slot for it.

A waiting request whose next uncached block is being computed right now by another request waits for that
block instead of computing the same prefix a second time.
"""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

from common.outputs import FinishReason
from worker.kv_cache_manager import KVCacheManager
from worker.sequence import Sequence, SequenceStatus


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_tokens: int


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int, max_loras: int = 0) -> None:
        self.kv = kv
        self.max_loras = max_loras
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Keys of prompt blocks that a running request is computing now -> that request's id.
        self.inflight: dict[bytes, str] = {}
        self.num_preemptions = 0
        self.num_computed_tokens = 0  # every token the model has run, prefill and decode

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Take in a sequence that already holds the blocks of its computed tokens (a choice forked from a
        request whose prompt was just computed, see ``Engine._fork_choices``): it decodes from the next step."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    @property
    def has_room(self) -> bool:
        """Whether one more sequence may run (``max_num_seqs``)."""
        return len(self.running) < self.max_num_seqs

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        preempted = False
        # Decodes (one token left to compute) before prefills; ties keep arrival order.
        for seq in sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.grow(seq, n):
                victim = self.running[-1]
                for i, item in enumerate(out):
                    if item.seq is victim:  # already planned this step: un-plan it
                        budget += out.pop(i).num_tokens
                        break
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                out.append(ScheduledSeq(seq, n))
                budget -= n
        if not preempted:
            budget = self._admit(budget, out)
        return out

    def _admit(self, budget: int, out: list[ScheduledSeq]) -> int:
        admitted: list[Sequence] = []
        adapters = self.running_adapters()
        blocked = False  # a request waits for an adapter slot: admit no other adapter's requests meanwhile
        for seq in self.waiting:
            if budget == 0 or len(self.running) + len(admitted) >= self.max_num_seqs:
                break
            adapter = seq.adapter.id if seq.adapter is not None else None
            if adapter is not None and (blocked or adapter not in adapters):
                if blocked or len(adapters) >= self.max_loras:
                    blocked = True
                    continue
            prefix = self.kv.find_prefix(seq)
            lower = self.kv.find_lower(seq, len(prefix))  # blocks host RAM holds after the GPU prefix: loaded
            nxt = len(prefix) + lower
            if nxt < len(seq.block_keys) and (
                seq.block_keys[nxt] in self.inflight or self.kv.is_loading(seq.block_keys[nxt])
            ):
                continue  # another request is computing this block (or it is read from disk): take it next step
            n = min(seq.num_tokens - nxt * self.kv.block_size, budget)
            if not self.kv.can_admit(seq, prefix, n, lower):
                break  # first come, first served on memory
            self.kv.admit(seq, prefix, n, lower)
            seq.status = SequenceStatus.RUNNING
            if seq.scheduled_time is None:  # (not again after a preemption)
                seq.scheduled_time = time.perf_counter()
            for key in seq.block_keys[nxt : seq.num_prompt_tokens // self.kv.block_size]:
                self.inflight.setdefault(key, seq.request_id)
            admitted.append(seq)
            if adapter is not None:
                adapters.add(adapter)
            out.append(ScheduledSeq(seq, n))
            budget -= n
        for seq in admitted:
            self.waiting.remove(seq)
            self.running.append(seq)
        return budget

    def running_adapters(self) -> set[str]:
        """The ids of the LoRA adapters of the running requests."""
        return {s.adapter.id for s in self.running if s.adapter is not None}

    def _release_inflight(self, seq: Sequence, keys: list[bytes] | None = None) -> None:
        for key in seq.block_keys if keys is None else keys:
            if self.inflight.get(key) == seq.request_id:
                del self.inflight[key]

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq)
        self._release_inflight(seq)
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def on_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Account for ``num_tokens`` of ``seq`` whose K/V the model just wrote."""
        seq.num_computed_tokens += num_tokens
        self.num_computed_tokens += num_tokens
        self._release_inflight(seq, self.kv.register(seq))

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End ``seq`` (running or waiting) and release its blocks."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.release(seq)
        self._release_inflight(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
