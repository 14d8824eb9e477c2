"""Streamed layers through a ring of slots: fetched ahead, waited on before use, released
after it.

Streamed layer ``s`` (its place among the streamed layers, in forward order) is bound once
to slot ``s % slots``; a slot holds its layers in turn. Releasing a layer starts the fetch
of the slot's next layer at once (after the last, the slot's first: the next forward's
layers arrive while the LM head, the sampler and the scheduler run). The model calls
:meth:`LayerStream.acquire` before a layer and :meth:`LayerStream.release` after it; a
resident layer's calls return at once.
"""

from __future__ import annotations

import time

from zserve.offload.layout import LayerLayout
from zserve.offload.plan import Plan
from zserve.offload.store import Fetch, Store, aligned_bytes


class LayerStream:
    """The slots of one model's streamed layers and their fetches (one thread drives it)."""

    def __init__(self, layouts: dict[int, LayerLayout], plan: Plan, store: Store) -> None:
        self.plan, self.store = plan, store
        self.order = plan.streamed
        self._pos = {layer: s for s, layer in enumerate(self.order)}
        self._k = plan.slots
        self.slots = [aligned_bytes(plan.slot_bytes) for _ in range(self._k)]
        for s, layer in enumerate(self.order):
            # bound on its own bytes: a zquant layer's bind reads values (its outlier count)
            slot = self.slots[s % self._k]
            store.fetch(layer, slot).wait()
            layouts[layer].bind(slot)
        self._sizes = {i: layouts[i].nbytes for i in self.order}
        self._holds: list[int | None] = [None] * self._k
        self._pending: list[Fetch | None] = [None] * self._k
        self.fetches = 0
        self.bytes_fetched = 0
        self.io_wait_s = 0.0
        """Seconds the compute thread waited on fetches not yet complete."""
        for j in range(self._k):
            self._issue(j, self.order[j])

    def streams(self, layer: int) -> bool:
        return layer in self._pos

    def _issue(self, j: int, layer: int) -> None:
        self._holds[j] = layer
        self._pending[j] = self.store.fetch(layer, self.slots[j])
        self.fetches += 1
        self.bytes_fetched += self._sizes[layer]

    def _wait(self, j: int) -> None:
        pending, self._pending[j] = self._pending[j], None
        if pending is None:
            return
        t0 = time.perf_counter()
        try:
            pending.wait()
        except BaseException:
            self._holds[j] = None  # its bytes are not the layer's: fetch again
            raise
        finally:
            self.io_wait_s += time.perf_counter() - t0

    def acquire(self, layer: int) -> None:
        """Block until ``layer``'s bytes are in its slot (fetching them now if the slot was
        filled for another layer)."""
        s = self._pos.get(layer)
        if s is None:
            return
        j = s % self._k
        if self._holds[j] != layer:
            self._wait(j)
            self._issue(j, layer)
        self._wait(j)

    def release(self, layer: int) -> None:
        """``layer`` is done: its slot starts fetching the slot's next layer."""
        s = self._pos.get(layer)
        if s is None:
            return
        j = s % self._k
        nxt = s + self._k if s + self._k < len(self.order) else j
        self._issue(j, self.order[nxt])

    def stats(self) -> dict[str, float | int | str]:
        return {
            "offload": self.store.kind,
            **self.plan.summary(),
            "fetches": self.fetches,
            "bytes_fetched": self.bytes_fetched,
            "io_wait_s": self.io_wait_s,
        }

    def close(self) -> None:
        for j in range(self._k):
            try:
                self._wait(j)
            except OSError:
                pass
        self.store.close()
