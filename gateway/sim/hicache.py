"""SGLang 0.5.23's hierarchical cache for one simulated server: a host tier and an L3 store of its own.

What the source does (file:line under sglang/srt/, the 0.5.23 wheel; docs/compat.md, section
"Keeping the prefix caches across a turn", has a row and a test for each):

- **Write-through** (``--hicache-write-policy write_through``, the default,
  ``arg_groups/fields/memory.py:121-127``): every prefix inserted in the radix tree is backed up
  to the host tier at once (``mem_cache/unified_cache/unified_tree_core.py:1104-1122``), a
  device -> host copy on its own stream behind the forward pass (``managers/cache_controller.py
  :885-920``); once acked, the node is queued for L3 (``mem_cache/unified_radix_cache.py
  :1803-1818``) and one CPU thread a rank writes it, one file a page a rank
  (``managers/cache_controller.py:1386-1461``, ``mem_cache/hicache_storage.py:883-927``). A page
  already in L3 is not written again (``hicache_storage.py:893-897``). Here: the new pages and
  the node's Mamba state, written one after the other at :data:`L3_WRITE_BYTES_PER_S` a rank.
- **Mamba states** (``mem_cache/unified_cache/components/mamba.py:227-253``, ``:917-928``): one
  whole recurrent state a node, stored under the node's last page; a hit is only as long as
  the deepest stored node that has one (``hicache_storage.py:1016-1033``). Here: a prompt's
  node ends at its last whole page.
- **Release** (``managers/scheduler_components/weight_updater.py:365-366`` -> ``flush_cache``):
  the tree and the host tier are dropped (``unified_radix_cache.py:448-451``) and so are the
  writes not yet in L3 (``cache_controller.py:815-834``); **L3 survives** (nothing on that path
  clears it). A paused server makes no HiCache progress (``managers/scheduler.py:2034-2036``):
  the turn waits, the outgoing server idle and unpaused, for :meth:`HiCache.drained_at`, bounded
  as the live gateway bounds it (``turns.keep_caches_within_s``).
- **A hit from L3** (``managers/scheduler.py:3480-3493``, prefetch policy ``wait_complete``,
  ``unified_radix_cache.py:2298-2301``): when at least :data:`PREFETCH_THRESHOLD_TOKENS` of a
  queued request's prompt beyond the device's match are stored, the request waits in the queue
  (skipped at admission, ``scheduler.py:4240-4255``) for the read, L3 -> host on one IO thread
  (``cache_controller.py:1155-1206``), then host -> device (``cache_controller.py:1028-1060``),
  and prefills only the tail.
- **Capacity**: the file backend's cap (``SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE``,
  ``mem_cache/storage/file/lru_file_evictor.py:56-150``) evicts the least recently used files;
  the host tier is ``--hicache-ratio`` (2.0) times the device pools
  (``arg_groups/hicache_hook.py:100-126``), Mamba states included (``mem_cache/hybrid_cache/
  hybrid_pool_assembler.py:239-254``).
- **Namespaces**: a store belongs to one page format. The MTP server packs its NEXTN draft layer
  into the same page object under the same key (13 layers against plain's 12:
  ``speculative/base_spec_worker.py:269-329``, ``mem_cache/pool_host/mha.py:206``), and a plain
  server reading an MTP page reads the first 12/13 of it without an error
  (``hicache_storage.py:846-868``): silent garbage. A real server cannot tell; the simulator
  refuses the configuration (:class:`NamespaceConflict`).

The engine (:mod:`gateway.sim.engine`) stays clockless: a driver with a clock
(:class:`gateway.sim.virtual.VirtualSim`) calls :meth:`HiCache.written` when the engine inserts
a prompt, :meth:`HiCache.lookup` when a request arrives, and :meth:`HiCache.release` at a
release.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from gateway.sim import memory

# --page-size 64 on both servers: the page hash covers page_size tokens (mem_cache/utils.py:116-152),
# so pages match only between servers of one page size; the engine's prefix cache uses the same
# blocks (engine.CACHE_BLOCK_TOKENS).
PAGE_TOKENS = 64
# A queued request's L3 query runs when at least this many of its tokens are not on the device
# (prefetch_threshold's default, mem_cache/hybrid_cache/hybrid_cache_controller.py:404,
# unified_radix_cache.py:2150-2156).
PREFETCH_THRESHOLD_TOKENS = 256
# Host -> device, per GPU: the default IO backend "kernel" (arg_groups/fields/memory.py:128-134)
# gathers scattered pages from pinned memory; 51 GB/s measured on one H200 for 64 KiB and
# 768 KiB pages alike (docs/turns.md, "Keeping the prefix caches across a turn"). The device ->
# host write-through copy runs on the same link the other way.
HOST_LINK_BYTES_PER_S = 51e9
# L3 on a tmpfs, one thread a rank (the file backend: one file a page a rank, read with one
# readinto, written as a temporary file then renamed). lab/scripts/hicache_file_probe.py, 2,000
# pages of 768 KiB on this project's 2-core build machine, three runs: reads 2.9-4.9 GB/s,
# writes 0.5-2.4 GB/s (the first run allocating tmpfs pages). Taken at the low middle: a
# server-class host is not slower at a memcpy; measure yours with the probe.
L3_READ_BYTES_PER_S = 3.0e9
L3_WRITE_BYTES_PER_S = 1.0e9
# What write-through costs the forward passes: the device -> host copy of a prefill step's new
# pages runs on its own stream and reads HBM beside the forward pass: 8,192 tokens x 12,288 B a
# rank = 0.1 GB, 2 ms at 51 GB/s, against a ~500 ms prefill step; the L3 thread is another
# process's CPU time (one a rank). Charged as 1 % of each prefill step's time, an upper bound of
# the copy's share with room for the scheduler's acks (urc:3651-3700), not measured.
WRITE_THROUGH_PREFILL_OVERHEAD = 0.01

PageFormat = Literal["plain", "mtp"]


class NamespaceConflict(ValueError):
    """Two page formats in one L3 namespace: the plain server would load the MTP server's pages
    (13 layers) as its own (12) without an error. SGLang 0.5.23 cannot detect it."""


@dataclass(frozen=True)
class StoreSpec:
    """One server's HiCache: its L3 namespace and page format, and the sizes and speeds that
    decide what it keeps and how long a load takes (bytes are the whole node's, all ranks)."""

    namespace: str  # a file_storage_path (or served model name): servers naming one share it
    page_format: PageFormat
    ranks: int
    bytes_per_token: int  # KV stored a token, all ranks (the draft layer packed in for MTP)
    mamba_state_bytes: int  # one node's Mamba state, all ranks
    capacity_bytes: float  # the L3 cap
    host_bytes: float  # the host tier
    l3_read_bytes_per_s: float = L3_READ_BYTES_PER_S  # a rank
    l3_write_bytes_per_s: float = L3_WRITE_BYTES_PER_S  # a rank
    host_link_bytes_per_s: float = HOST_LINK_BYTES_PER_S  # a GPU

    @property
    def page_bytes(self) -> int:
        return PAGE_TOKENS * self.bytes_per_token

    def _per_rank(self, tokens: int) -> float:
        return (tokens * self.bytes_per_token + self.mamba_state_bytes) / self.ranks

    def read_s(self, tokens: int) -> float:
        """L3 -> host: ``tokens`` of pages and their node's Mamba state, each rank its share."""
        return self._per_rank(tokens) / self.l3_read_bytes_per_s

    def copy_s(self, tokens: int) -> float:
        """Host -> device: ``tokens`` of pages and a Mamba state, each GPU its share."""
        return self._per_rank(tokens) / self.host_link_bytes_per_s

    def load_s(self, tokens: int) -> float:
        """Seconds to bring ``tokens`` of stored prefix from L3 to the device, alone."""
        return self.read_s(tokens) + self.copy_s(tokens)


def store_spec(speculative: bool, *, namespace: str, gpus: int, capacity_bytes: float | None = None,
               host_bytes: float | None = None, model: memory.ModelConfig = memory.QWEN35_122B,
               ) -> StoreSpec:
    """A server's store from the model's shapes (gateway.sim.memory): KV bytes a token a rank
    times the ranks (49,152 B plain, 53,248 B with MTP's draft layer at TP 4) and a Mamba state
    a rank times the ranks (~154 MB at TP 4); its host tier and L3 cap the deploy files' (the
    host-memory table, :func:`gateway.sim.memory.hicache_host_memory`) unless given."""
    per_token = model.kv_bytes_per_token(gpus, draft=speculative) * gpus
    state = model.mamba_bytes_per_request(gpus) * gpus
    deployed = memory.hicache_host_memory(model=model)["mtp" if speculative else "plain"]
    if capacity_bytes is None:
        capacity_bytes = deployed.l3_cap_gib * memory.GIB * deployed.ranks
    if host_bytes is None:
        host_bytes = deployed.host_tier_gib * memory.GIB
    return StoreSpec(namespace=namespace, page_format="mtp" if speculative else "plain", ranks=gpus,
                     bytes_per_token=per_token, mamba_state_bytes=state, capacity_bytes=capacity_bytes,
                     host_bytes=host_bytes)


class _Tier:
    """Pages by key and Mamba states by their node's last page key, least recently used
    evicted first at ``capacity`` bytes."""

    def __init__(self, capacity: float, page_bytes: int, state_bytes: int) -> None:
        self.capacity, self.page_bytes, self.state_bytes = capacity, page_bytes, state_bytes
        self._entries: OrderedDict[tuple[bool, int], None] = OrderedDict()  # (is_state, key)
        self.used = 0.0

    def __contains__(self, entry: tuple[bool, int]) -> bool:
        return entry in self._entries

    def put(self, keys: Sequence[int], state_key: int | None) -> None:
        entries = [(False, k) for k in keys] + ([(True, state_key)] if state_key is not None else [])
        for entry in entries:
            if entry in self._entries:
                self._entries.move_to_end(entry)
                continue
            self._entries[entry] = None
            self.used += self.state_bytes if entry[0] else self.page_bytes
        while self.used > self.capacity and self._entries:
            (is_state, _), _ = self._entries.popitem(last=False)
            self.used -= self.state_bytes if is_state else self.page_bytes

    def touch(self, keys: Sequence[int], state_key: int) -> None:
        for entry in [(False, k) for k in keys] + [(True, state_key)]:
            if entry in self._entries:
                self._entries.move_to_end(entry)

    def clear(self) -> None:
        self._entries.clear()
        self.used = 0.0

    @property
    def pages(self) -> int:
        return sum(1 for is_state, _ in self._entries if not is_state)


class L3Store:
    """One L3 namespace: the directory every server naming it reads and writes."""

    def __init__(self, spec: StoreSpec) -> None:
        self.namespace, self.page_format = spec.namespace, spec.page_format
        self.tier = _Tier(spec.capacity_bytes, spec.page_bytes, spec.mamba_state_bytes)

    def attach(self, spec: StoreSpec) -> None:
        if spec.page_format != self.page_format:
            raise NamespaceConflict(
                f"L3 namespace {spec.namespace!r} holds {self.page_format} pages and a {spec.page_format} "
                f"server was given it: the plain server would load the MTP server's pages (its NEXTN "
                f"draft layer packed in, 13 layers against 12) as its own KV without an error "
                f"(mem_cache/hicache_storage.py:846-868). Give each server its own "
                f"--hicache-storage-backend-extra-config file_storage_path (or served model name).")


class Load(NamedTuple):
    tokens: int  # the prompt's stored prefix the request starts from
    ready_at: float  # when its read is done and it may be admitted


@dataclass
class _Write:
    done_at: float
    keys: list[int]
    state_key: int


class HiCache:
    """One server's host tier and its view of its L3 namespace, on a clock the caller passes."""

    def __init__(self, spec: StoreSpec, store: L3Store, keys: Callable[[Sequence[int]], list[int]]) -> None:
        store.attach(spec)
        self.spec, self.store, self._keys = spec, store, keys
        self.host = _Tier(spec.host_bytes, spec.page_bytes, spec.mamba_state_bytes)
        self._pending: deque[_Write] = deque()
        self._writer_free_at = -math.inf
        self._reader_free_at = -math.inf
        self.written_tokens = 0  # pages put in L3, in tokens (sglang:backuped_tokens_total)
        self.loaded_tokens = 0  # prompt tokens requests started from instead of prefilling
        self.dropped_tokens = 0  # pages a release dropped before they reached L3

    def written(self, prompt: Sequence[int], now: float, reused: int = 0) -> None:
        """The engine inserted ``prompt``, of which the request started from ``reused``
        tokens: the tree's new leaf, the pages past them, and its node's state are backed up
        (write-through, unified_tree_core.py:1104-1122); pages already in L3 are refreshed, not
        rewritten (hicache_storage.py:893-897). A page of the reused part is never written
        again, even if L3 evicted it meanwhile."""
        keys = self._keys(prompt)
        leaf = keys[reused // PAGE_TOKENS:]
        if not leaf:
            return
        self.settle(now)
        self.host.put(keys, keys[-1])
        new = [k for k in leaf if (False, k) not in self.store.tier]
        state_key = keys[-1]
        self.store.tier.touch(leaf, state_key)
        per_rank = (len(new) * self.spec.page_bytes + self.spec.mamba_state_bytes) / self.spec.ranks
        done = max(now, self._writer_free_at) + per_rank / self.spec.l3_write_bytes_per_s
        self._writer_free_at = done
        self._pending.append(_Write(done, new, state_key))

    def settle(self, now: float) -> None:
        """The writes done by ``now`` are in L3."""
        while self._pending and self._pending[0].done_at <= now:
            write = self._pending.popleft()
            self.store.tier.put(write.keys, write.state_key)
            self.written_tokens += len(write.keys) * PAGE_TOKENS

    def drained_at(self, now: float) -> float:
        """When the last queued write reaches L3 (``now`` when none is queued)."""
        return self._pending[-1].done_at if self._pending else now

    def release(self, now: float) -> int:
        """A release of the KV cache: the host tier and the writes not yet in L3 are dropped;
        returns the tokens dropped. L3 keeps what reached it."""
        self.settle(now)
        dropped = sum(len(w.keys) for w in self._pending) * PAGE_TOKENS
        self.dropped_tokens += dropped
        self._pending.clear()
        self._writer_free_at = now
        self.host.clear()
        return dropped

    def stored(self, prompt: Sequence[int], now: float) -> tuple[int, int]:
        """(tokens of ``prompt`` a hit would give, of which from L3): the deepest page of its
        prefix, every page before it in the host tier or L3, whose node has a Mamba state."""
        return self.stored_keys(self._keys(prompt), now)

    def stored_keys(self, keys: Sequence[int], now: float) -> tuple[int, int]:
        """:meth:`stored` for a prompt's page keys."""
        self.settle(now)
        store, host = self.store.tier, self.host
        hit = from_l3 = 0
        l3_pages = 0
        for i, key in enumerate(keys):
            page = (False, key)
            in_host = page in host
            if not in_host and page not in store:
                break
            l3_pages += not in_host
            state = (True, key)
            if state in host or state in store:
                hit, from_l3 = (i + 1) * PAGE_TOKENS, l3_pages * PAGE_TOKENS
        return hit, from_l3

    def lookup(self, prompt: Sequence[int], device_tokens: int, now: float) -> Load | None:
        """A request queued now whose prompt the device holds ``device_tokens`` of: the load it
        waits for, or None when the store adds less than the prefetch threshold."""
        hit, from_l3 = self.stored(prompt, now)
        if hit - device_tokens < PREFETCH_THRESHOLD_TOKENS:
            return None
        keys = self._keys(prompt)[: hit // PAGE_TOKENS]
        self.store.tier.touch(keys, keys[-1])
        self.host.put(keys, keys[-1])  # staged through the host tier
        start = max(now, self._reader_free_at)  # one IO thread a rank: reads queue
        read = self.spec.read_s(from_l3) if from_l3 else 0.0
        self._reader_free_at = start + read
        self.loaded_tokens += hit - device_tokens
        return Load(hit, start + read + self.spec.copy_s(hit - device_tokens))


class Stores:
    """The L3 namespaces of one simulated host, by name: servers naming one share it."""

    def __init__(self) -> None:
        self.by_namespace: dict[str, L3Store] = {}

    def open(self, spec: StoreSpec) -> L3Store:
        store = self.by_namespace.get(spec.namespace)
        if store is None:
            store = self.by_namespace[spec.namespace] = L3Store(spec)
        return store

