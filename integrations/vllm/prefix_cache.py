"""Blended K/V never becomes a hit of vLLM's prefix cache (scheduler side).

What vLLM 0.32 does with blocks a connector loads: ``KVCacheManager.allocate_slots`` allocates them
with the request's other blocks and registers every full block up to the tokens scheduled, the
loaded ones included, in the prefix cache under the hash of the token ids up to it
(``vllm/v1/core/kv_cache_manager.py`` allocate_slots -> ``coordinator.cache_blocks`` ->
``BlockPool.cache_full_blocks``); it keeps doing so for the blocks vLLM computes on top of them,
decode included. A blended block is an approximation of that prefix's K/V (CacheBlend: stored chunks
fused, ~15% recomputed). Registered, it would be served as exact to every later request with the
same ids up to it: a ``ragkv_skip`` request asking for vLLM's own prefill, a baseline, or a prompt
the store no longer holds the chunks of.

So ragkv keeps vLLM's prefix cache exact: every block of a blended request from the first block
the connector writes on (the blended ones, and those vLLM computed after them, whose K/V attended to
the blend) is taken out of the prefix cache with ``BlockPool.evict_blocks`` (the hash only: the
request keeps using its blocks, and they go back to the free list as uncached ones). It happens
right after vLLM allocates the request's blocks (``update_state_after_alloc``, before the scheduler
looks at the next waiting request), after every scheduler step (``build_connector_meta``: the blocks
that step registered) and when the request finishes. The blocks before the first written one (a
system prefix vLLM computed itself) stay cached and are only read. The price: the same prompt sent
again is blended again (ragkv's store is its cache), unless vLLM has meanwhile prefilled it itself.

One window remains: within one scheduler step, a request admitted after a blended one could match a
block that step registered for it, but only if a third request with the same ids had re-registered
every blended block before it with vLLM's own K/V (the chain of hashes is broken at the first
blended block otherwise).
"""

from __future__ import annotations


class BlendedBlocks:
    """The blended requests whose blocks vLLM must not serve from its prefix cache."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._first: dict[str, int] = {}  # request id -> index of its first block the connector writes
        self._manager = None  # vLLM's KVCacheManager (bind), None while prefix caching is off

    def bind(self, manager) -> None:
        self._manager = manager if getattr(manager, "enable_caching", False) else None

    def watch(self, req_id: str, start: int) -> None:
        """The connector writes the request's prompt from token ``start`` on."""
        self._first[req_id] = start // self.block_size
        self._evict(req_id)

    def step(self) -> None:
        for req_id in list(self._first):
            self._evict(req_id)

    def finish(self, req_id: str) -> None:
        if req_id in self._first:
            self._evict(req_id)
            del self._first[req_id]

    def _evict(self, req_id: str) -> None:
        if self._manager is None:
            return
        first = self._first[req_id]
        groups = self._manager.get_blocks(req_id).blocks  # none once freed (preempted)
        cached = {b.block_id for group in groups for b in group[first:] if b.block_hash is not None}
        if cached:
            self._manager.block_pool.evict_blocks(cached)
