"""Every sequence in flight in one KV tensor, a slot each: batched attention without copies.

A target verifies a few dozen sequences at most, each with its own cache. The gather path
(:class:`~starsd.batch.RaggedBatch`) copies every row's whole cache into a padded batch and its
new part back out on every forward (for the default target, 20 layers at 300 positions and 8
rows, a 49 MB copy each way); giving each row a store of its own and attending row by row copies
nothing but runs a few small kernels per row and layer (1,000+ kernels a forward at 8 rows, a
third of the time of a batched verification). Here every sequence's keys and values live in one
tensor ``whole`` [layers, 2, slots, kv heads, capacity, d], one slot per sequence: a forward writes
each row's new keys with one indexed copy per layer and attends over the slot range its rows
span with ONE attention per layer (rows of the range outside the batch are computed and
dropped: cheaper than a copy or a kernel per row while the range is dense; a sparse batch
attends row by row over its slots' views).

Caches stay :class:`~starsd.batch.SequenceCache` objects, views of their slot, so the verifier's
crop and the gather path work on them unchanged. A slot belongs to the sequence whose caches
view it and returns to the pool when the last of them is gone (the sequence finished); the pool
tensor grows (slots doubling, capacity in ``ROW_CHUNK`` steps) by one copy that re-points every
live view, and is dropped when no slot is in use.

Threads: the model thread runs forwards (reserve, grow, write); any thread may drop a cache and
so release its slot. The free list, the live views and ``whole`` are under ``_lock``.
"""

from __future__ import annotations

import heapq
import threading
import weakref
from collections.abc import Sequence

import torch

from starsd.batch import ROW_CHUNK, SequenceCache
from starsd.llama import attention

# A batch attends over its slot range at once while the range spans at most this many slots per
# row (+ 2): a slot outside the batch costs one row of attention, a kernel per row costs more.
DENSE_SLOTS_PER_ROW = 2


class Slot:
    """One sequence's row of a pool; released when the last cache viewing it is gone."""

    def __init__(self, pool: KVPool, index: int) -> None:
        self.index = index
        weakref.finalize(self, pool._release, index)


class KVPool:
    """The KV caches of one model's sequences in flight (see the module docstring)."""

    def __init__(
        self, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device
    ) -> None:
        """``shape``: (layers, kv heads, head dim) of the model's caches."""
        self.shape, self.dtype, self.device = shape, dtype, device
        self.whole: torch.Tensor | None = None  # [layers, 2, slots, kv, capacity, d]
        self._free: list[int] = []  # a heap: the lowest free slot first, so batches stay dense
        self._next = 0  # slots handed out so far (the highest index + 1)
        self._used = 0
        self._views: weakref.WeakKeyDictionary[SequenceCache, Slot] = weakref.WeakKeyDictionary()
        # re-entrant: dropping the last view of a slot inside a locked section (the garbage
        # collector runs finalizers in whichever thread frees the cache) releases it there
        self._lock = threading.RLock()

    @property
    def slots(self) -> int:
        """Slots the pool has room for."""
        return 0 if self.whole is None else int(self.whole.shape[2])

    @property
    def capacity(self) -> int:
        """Positions every slot has room for."""
        return 0 if self.whole is None else int(self.whole.shape[4])

    @property
    def in_use(self) -> int:
        """Slots held by live sequences."""
        return self._used

    def slot_of(self, cache: SequenceCache) -> Slot | None:
        """The slot ``cache`` views, None when it is not in this pool."""
        return self._views.get(cache)

    def adopt(self, cache: SequenceCache, room: int) -> SequenceCache:
        """``cache`` itself when it is already here (room made, no copy: a growth re-points
        it), else a view of a new slot its positions are copied into once; room for ``room``
        more positions either way."""
        if self.slot_of(cache) is not None:
            self.fit(cache.length + room)
            return cache
        slot = self._reserve()
        self.fit(cache.length + room)
        assert self.whole is not None
        if cache.kv is not None:
            self.whole[:, :, slot.index, :, : cache.length] = cache.kv
        return self.view(slot, cache.length)

    def view(self, slot: Slot, length: int) -> SequenceCache:
        """A cache of the slot's first ``length`` positions (kept pointing at the pool)."""
        with self._lock:
            return self._view_locked(slot, length)

    def _view_locked(self, slot: Slot, length: int) -> SequenceCache:
        assert self.whole is not None
        store = self.whole[:, :, slot.index]  # [layers, 2, kv, capacity, d]
        cache = SequenceCache(store[:, :, :, :length], store)
        self._views[cache] = slot
        return cache

    def fit(self, positions: int) -> None:
        """Room for ``positions`` in every slot (and for every reserved slot)."""
        with self._lock:
            if positions <= self.capacity and self._next <= self.slots:
                return
            slots = max(self._next, 2 * self.slots if self._next > self.slots else self.slots)
            capacity = -(-max(positions, self.capacity) // ROW_CHUNK) * ROW_CHUNK
            self._grow(slots, capacity)

    def _grow(self, slots: int, capacity: int) -> None:
        """A bigger tensor, zeroed (a masked column must never be NaN), the old one copied in,
        every live view re-pointed (lock held)."""
        layers, heads, dim = self.shape
        size = (layers, 2, slots, heads, capacity, dim)
        whole = torch.zeros(size, dtype=self.dtype, device=self.device)
        if self.whole is not None:
            whole[:, :, : self.slots, :, : self.capacity] = self.whole
        self.whole = whole
        for cache, slot in list(self._views.items()):
            store = whole[:, :, slot.index]
            cache.kv, cache.store = store[:, :, :, : cache.length], store

    def _reserve(self) -> Slot:
        """The lowest free slot (room for it is made by the next :meth:`fit`)."""
        with self._lock:
            if self._free:
                index = heapq.heappop(self._free)
            else:
                index, self._next = self._next, self._next + 1
            self._used += 1
            return Slot(self, index)

    def _release(self, index: int) -> None:
        """A sequence is gone (any thread): its slot is free; no slot used: memory back."""
        with self._lock:
            self._used -= 1
            heapq.heappush(self._free, index)
            if self._used == 0:
                self.whole, self._free, self._next = None, [], 0


class PooledRows:
    """A ragged batch whose rows all live in one :class:`KVPool`.

    The :class:`starsd.llama.KeyValues` of a forward (``attend``: ``write``, then
    ``attend_stored``). Row i feeds
    ``f_i`` tokens after its ``c_i`` cached positions; the feed is right-padded to F, and a
    padding column's keys land past the row's length (where nothing reads them). Used from the
    model thread only.
    """

    def __init__(
        self,
        pool: KVPool,
        caches: Sequence[SequenceCache],
        fed: Sequence[int],
        feed_masks: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        self.pool = pool
        self.layers = pool.shape[0]
        self.fed = tuple(fed)
        # per row, [f, f] bool over its own feed (starsd.tree.feed_mask: a token tree); None:
        # causal
        self.feed_masks = tuple(feed_masks) if feed_masks is not None else (None,) * len(fed)
        width = max(self.fed)
        # adopting a row may grow the pool: earlier rows' views are re-pointed with it
        self.rows = [pool.adopt(c, width) for c in caches]
        self.start = tuple(r.length for r in self.rows)
        self._slots = [self._slot(r) for r in self.rows]
        index = torch.tensor([s.index for s in self._slots], device=pool.device)  # [B]
        self._index = index
        self._columns = torch.tensor(self.start, device=pool.device)[:, None] + torch.arange(
            width, device=pool.device
        )  # [B, F]: where each row's feed lands
        self._low = int(index.min())
        span = int(index.max()) - self._low + 1
        # One attention over the slot range while it is dense (see the module docstring).
        self._dense = span <= DENSE_SLOTS_PER_ROW * len(self.rows) + 2
        self._span = span
        # the rows ARE the range, in order: queries and outputs need no scatter / gather
        self._exact = span == len(self.rows) and bool(
            (index == self._low + torch.arange(span, device=pool.device)).all()
        )
        self._keys = max(c + f for c, f in zip(self.start, self.fed, strict=True))
        self._allowed: torch.Tensor | None = None

    def _slot(self, cache: SequenceCache) -> Slot:
        slot = self.pool.slot_of(cache)
        assert slot is not None  # (adopt registered it)
        return slot

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store every row's new keys / values [B, kv heads, F, d] at its own positions."""
        whole = self.pool.whole
        assert whole is not None
        if len(self.rows) == 1:  # one row: a plain slice copy is cheaper than an indexed one
            slot, start, width = self._slots[0].index, self.start[0], keys.shape[2]
            whole[layer, 0, slot, :, start : start + width] = keys[0]
            whole[layer, 1, slot, :, start : start + width] = values[0]
            return
        rows = self._index[:, None]  # [B, 1]
        whole[layer, 0, rows, :, self._columns] = keys.transpose(1, 2)  # [B, F, kv, d]
        whole[layer, 1, rows, :, self._columns] = values.transpose(1, 2)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """:class:`starsd.llama.KeyValues`: store this layer's new keys, then attend."""
        self.write(layer, k, v)
        return self.attend_stored(layer, q, scale)

    def attend_stored(self, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Each row's queries [B, heads, F, d] over its own keys, causal within its feed ->
        [B, F, heads, d] (a padding query's output is left as computed: nothing reads it)."""
        whole = self.pool.whole
        assert whole is not None
        if not self._dense:
            return self._attend_each(whole[layer], query, scale)
        low, span = self._low, self._span
        keys = whole[layer, 0, low : low + span, :, : self._keys]  # [R, kv, T, d]
        values = whole[layer, 1, low : low + span, :, : self._keys]
        if self._exact:
            return attention(query, keys, values, self._range_mask(), scale)
        rows = self._index - low  # [B]: each row's place in the range
        wide = query.new_zeros(span, *query.shape[1:])  # [R, heads, F, d]
        wide[rows] = query
        return attention(wide, keys, values, self._range_mask(), scale)[rows]

    def _range_mask(self) -> torch.Tensor | None:
        """[R, 1, F, T] bool, made once per forward: row b's query j sees its keys up to
        position c_b + min(j, f_b - 1); a slot of the range outside the batch, key 0 only.
        None where that is every key (one query per row, rows of one length, none outside)."""
        uniform = len(set(self.start)) == 1 and len(set(self.fed)) == 1
        if self._exact and uniform and self.fed[0] == 1 and not any(self.feed_masks):
            return None
        if self._allowed is None:
            device = self._index.device
            width = self._columns.shape[1]
            fed = torch.tensor(self.fed, device=device)[:, None]  # [B, 1]
            last = self._columns[:, :1] + torch.minimum(
                torch.arange(width, device=device)[None, :], fed - 1
            )  # [B, F]
            limit = torch.zeros(self._span, width, dtype=torch.long, device=device)
            limit[self._index - self._low] = last
            self._allowed = (torch.arange(self._keys, device=device) <= limit[..., None])[:, None]
            for row, mask in enumerate(self.feed_masks):
                if mask is not None:  # a tree's row: its feed sees what the mask says
                    at, start = int(self._index[row]) - self._low, self.start[row]
                    width_b = self.fed[row]
                    self._allowed[at, 0, :width_b, start : start + width_b] = mask.to(device)
        return self._allowed

    def _attend_each(self, whole: torch.Tensor, query: torch.Tensor, scale: float) -> torch.Tensor:
        """A sparse batch: each row over its slot's keys (whole: one layer's [2, S, kv, C, d])."""
        out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
        for row, (slot, start, fed) in enumerate(
            zip(self._slots, self.start, self.fed, strict=True)
        ):
            keys = whole[0, slot.index, :, : start + fed][None]  # [1, kv, T, d]
            values = whole[1, slot.index, :, : start + fed][None]
            causal = None
            if fed > 1:
                col = torch.arange(start + fed, device=query.device)
                causal = col[None, :] <= start + torch.arange(fed, device=query.device)[:, None]
                mask = self.feed_masks[row]
                if mask is not None:
                    causal[:, start:] = mask.to(query.device)
                causal = causal[None, None]  # [1, 1, f, T]
            out[row, :fed] = attention(query[row : row + 1, :, :fed], keys, values, causal, scale)[
                0
            ]
        return out

    def result(self, row: int) -> SequenceCache:
        """Row ``row``'s cache after the forward: its cached and fed positions (a new view)."""
        return self.pool.view(self._slots[row], self.start[row] + self.fed[row])
