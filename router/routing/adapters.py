"""Which LoRA adapters each worker group holds, as one router replica sees it: the adapters it routed there
lately (``AdapterResidency``). A group keeps its most recently used adapters on the device (``lora.max_loras``
slots, least recently used leaves first), so the last ``slots`` adapters routed to it are a close estimate
without asking the group. A request under an adapter its group lacks pays the adapter's load before it
computes: the router charges that as ``load_tokens`` prefill-token equivalents in its cost."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

ADAPTER_LOAD_TOKENS = 256.0  # prefill-token equivalents of loading an adapter into a group's slots
ADAPTER_SLOTS = 8  # the serve config's lora.max_loras default


class AdapterResidency:
    def __init__(self, slots: int = ADAPTER_SLOTS, load_tokens: float = ADAPTER_LOAD_TOKENS) -> None:
        self.slots, self.cost = slots, load_tokens
        self._lately: dict[str, OrderedDict[str, None]] = {}  # group -> adapter ids, most recent last

    def used(self, group: str, adapter: str) -> None:
        """A request under ``adapter`` was routed to ``group``."""
        lately = self._lately.setdefault(group, OrderedDict())
        lately[adapter] = None
        lately.move_to_end(adapter)
        while len(lately) > self.slots:
            lately.popitem(last=False)

    def holds(self, group: str, adapter: str) -> bool:
        return adapter in self._lately.get(group, ())

    def load_tokens(self, adapter: str, groups: Iterable[str]) -> dict[str, float]:
        """The load cost of ``adapter`` on each of ``groups`` that does not hold it."""
        return {g: self.cost for g in groups if not self.holds(g, adapter)}

    def drop_group(self, group: str) -> None:
        """A group left or restarted (empty slots)."""
        self._lately.pop(group, None)
