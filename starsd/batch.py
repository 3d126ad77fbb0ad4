"""Ragged batches over per-sequence KV caches: gather, one padded forward, scatter back.

One problem with two users: the hub drafts many sessions in one forward (each with its own
draft cache), and a target verifies many sequences in one forward. Pure torch; it knows no model
and imports no transformers (``models.py`` wraps a :class:`LayerBuffer` in a transformers cache
layer; the EAGLE head attends over it directly).

Layout of a batch of B rows, row i with ``c_i`` cached positions and ``f_i`` tokens to feed
(C = max c_i, F = max f_i, ``steps`` decode steps after the feed)::

    columns [0, C)                 cached keys, right-aligned: row i's at [C - c_i, C)
    columns [C, C + F)             the fed tokens, left-aligned: row i's at [C, C + f_i)
    columns [C + F, C + F + steps) one column per decode step, every row

Padding columns are masked out as keys. The feed is padded on the RIGHT so that a padding query
still sees its own row's real keys: a query that sees nothing gets a NaN softmax, and a later
layer's keys computed from that NaN would poison the real rows through the masked score (NaN
plus -inf is NaN). Every row's decode steps land in the same column, so one buffer serves the
whole batch without copies between steps.

Why a gather and a scatter rather than a paged cache: transformers' attention wants dense
[B, heads, T, d] keys, and at hub scale (a few layers, a few hundred positions) copying each
session's cache in and its new part out once per proposal costs less than the forwards it
batches (measured by ``scripts.bench.service``), while a session keeps a compact tensor of its
own that a verdict crops with a slice.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [heads, T, d]
ROW_CHUNK = 128  # a growing cache's store is a multiple of this many positions


@dataclass(eq=False)  # identity, not value: caches are keys of a pool's weak table
class SequenceCache:
    """One sequence's KV cache, owned by whoever owns the sequence (no batch dimension).

    Every layer's keys and values live in ONE tensor ``kv`` [layers, 2, heads, T, d], so a batch
    gathers a row with one copy and scatters it with one (per layer and per k/v, those copies
    were most of the batching overhead of a small draft model). Models whose layers differ in
    heads or head size are not supported (no model StarSD serves has them).
    """

    kv: torch.Tensor | None = None  # [layers, 2, heads, T, d]; None until the first forward
    # [layers, 2, heads, capacity, d] that ``kv`` is the start of, when the cache is a slot of a
    # starsd.kvpool.KVPool (it grows in place there); None for a compact cache (the gather path)
    store: torch.Tensor | None = None

    @classmethod
    def from_layers(cls, layers: KV) -> SequenceCache:
        """A cache holding these per-layer (keys, values), each [heads, T, d] (copies)."""
        if not layers:
            return cls()
        return cls(torch.stack([torch.stack([k, v]) for k, v in layers]))

    @property
    def layers(self) -> KV:
        """Per layer (keys, values) views, each [heads, T, d]."""
        if self.kv is None:
            return []
        return [(layer[0], layer[1]) for layer in self.kv.unbind(0)]

    @property
    def length(self) -> int:
        """Number of positions held."""
        return int(self.kv.shape[3]) if self.kv is not None else 0

    def crop(self, length: int) -> None:
        """Keep exactly the first ``length`` positions (a view: the next scatter copies anyway).

        Raises:
            ValueError: if ``length`` is negative or longer than the cache.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        if self.kv is not None:
            self.kv = self.kv[:, :, :, :length]

    def extended(self, more: SequenceCache) -> SequenceCache:
        """A new cache: these positions, then ``more``'s (copies both)."""
        if self.kv is None or more.kv is None:
            return SequenceCache(more.kv if self.kv is None else self.kv)
        return SequenceCache(torch.cat([self.kv, more.kv], dim=3))

    def prefix(self, length: int) -> SequenceCache:
        """A view of the first ``length`` positions (this cache is left as it is)."""
        view = SequenceCache(self.kv)
        view.crop(length)
        return view

    def keep(self, start: int, columns: Sequence[int]) -> None:
        """Keep the first ``start`` positions, then the positions ``start + c`` for each c of
        ``columns`` (ascending), moved down to follow them; crop the rest. A token tree's
        accepted path (:func:`starsd.tree.kept_columns`) is compacted this way, in place (for a
        pool slot, in the pool)."""
        if self.kv is None or not columns:
            self.crop(min(start, self.length))
            return
        source = torch.tensor([start + c for c in columns], device=self.kv.device)
        moved = self.kv.index_select(3, source)  # [layers, 2, heads, k, d] (a copy)
        self.kv[:, :, :, start : start + len(columns)] = moved
        self.crop(start + len(columns))

    def nbytes(self) -> int:
        """Bytes of keys and values this sequence holds."""
        return self.kv.nbytes if self.kv is not None else 0


class LayerBuffer:
    """One layer's keys and values for a whole batch, preallocated; appends write in place."""

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        filled: int,
        whole: torch.Tensor | None = None,
    ) -> None:
        self.keys = keys  # [B, heads, capacity, d]
        self.values = values  # [B, heads, capacity, d]
        self.filled = filled  # columns written so far
        self.whole = whole  # [layers, 2, B, heads, capacity, d] of a gather, which these view

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new columns [B, heads, n, d]; returns views of every filled column."""
        end = self.filled + keys.shape[2]
        if end > self.keys.shape[2]:
            raise ValueError(f"batch buffer full: {end} columns > {self.keys.shape[2]}")
        self.keys[:, :, self.filled : end] = keys
        self.values[:, :, self.filled : end] = values
        self.filled = end
        return self.keys[:, :, :end], self.values[:, :, :end]


@dataclass(frozen=True)
class RaggedBatch:
    """Where each row's cached, fed and decoded positions sit in one padded batch."""

    cached: tuple[int, ...]  # c_i: positions already in row i's cache
    fed: tuple[int, ...]  # f_i: tokens row i feeds first (0 only where c_i > 0)
    steps: int  # decode steps (one token per row each) after the feed

    def __post_init__(self) -> None:
        if len(self.cached) != len(self.fed) or not self.fed:
            raise ValueError("a ragged batch needs one cached and one fed count per row")
        # A row with no key at all would have its padding queries see nothing (a NaN softmax).
        empty = [c + f < 1 for c, f in zip(self.cached, self.fed, strict=True)]
        if any(empty) or min(self.fed) < 0 or min(self.cached) < 0 or self.steps < 0:
            raise ValueError(f"bad ragged batch: cached {self.cached} fed {self.fed}")

    @property
    def rows(self) -> int:
        """B, the number of sequences."""
        return len(self.fed)

    @property
    def cached_width(self) -> int:
        """C: columns before the feed."""
        return max(self.cached)

    @property
    def fed_width(self) -> int:
        """F: columns of the feed."""
        return max(self.fed)

    @property
    def capacity(self) -> int:
        """Columns the batch buffer needs: C + F + steps."""
        return self.cached_width + self.fed_width + self.steps

    def input_ids(self, feeds: Sequence[Sequence[int]], pad: int = 0) -> torch.Tensor:
        """The feed as [B, F] long, each row's tokens first, ``pad`` after."""
        ids = torch.full((self.rows, self.fed_width), pad, dtype=torch.long)
        for row, tokens in enumerate(feeds):
            ids[row, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
        return ids

    def feed_positions(self) -> torch.Tensor:
        """Position ids [B, F] of the feed; a padding column repeats its row's last position."""
        offsets = torch.arange(self.fed_width)[None, :]  # [1, F]
        return self._cached[:, None] + torch.minimum(offsets, self._fed[:, None] - 1)  # [B, F]

    def step_positions(self, step: int) -> torch.Tensor:
        """Position ids [B, 1] of decode step ``step`` (0-based)."""
        return (self._cached + self._fed + step)[:, None]

    def last_fed(self) -> torch.Tensor:
        """Index [B] into the F feed columns of each row's last real token."""
        return self._fed - 1

    @property
    def padded(self) -> bool:
        """Whether any column is padding (rows differ in cached or fed length)."""
        return len(set(self.cached)) > 1 or len(set(self.fed)) > 1

    def mask(self, columns: int) -> torch.Tensor | None:
        """:meth:`key_mask`, or None when nothing is padding (attention then needs no mask)."""
        return self.key_mask(columns) if self.padded else None

    def key_mask(self, columns: int) -> torch.Tensor:
        """[B, columns] long: 1 where a column holds a row's real key, 0 for padding."""
        col = torch.arange(columns)[None, :]  # [1, T]
        c_max, f_max = self.cached_width, self.fed_width
        cached = (col >= c_max - self._cached[:, None]) & (col < c_max)
        fed = (col >= c_max) & (col < c_max + self._fed[:, None])
        return (cached | fed | (col >= c_max + f_max)).long()

    def tree_mask(self, feed_masks: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """[B, F, T] bool (True: attend; T the capacity) for a feed where some rows are token
        trees: every query sees its row's cached keys; over the feed, a tree row's real queries
        see what its ``feed_masks[row]`` [f_i, f_i] says, the others (chain rows, padding
        queries) the real fed keys up to their own column. No decode steps follow a tree."""
        if self.steps:
            raise ValueError("a feed with token trees takes no decode steps")
        c_max, f_max = self.cached_width, self.fed_width
        real = self.key_mask(self.capacity).bool()  # [B, T]
        allowed = real[:, None, :].repeat(1, f_max, 1)  # [B, F, T]
        allowed[:, :, c_max:] &= torch.ones(f_max, f_max, dtype=torch.bool).tril()
        for row, mask in enumerate(feed_masks):
            if mask is not None:
                fed = self.fed[row]
                allowed[row, :fed, c_max : c_max + fed] = mask
        return allowed

    @functools.cached_property
    def _cached(self) -> torch.Tensor:
        return torch.tensor(self.cached)  # [B]

    @functools.cached_property
    def _fed(self) -> torch.Tensor:
        return torch.tensor(self.fed)  # [B]

    def gather(
        self,
        caches: Sequence[SequenceCache],
        shapes: Sequence[tuple[int, int]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> list[LayerBuffer]:
        """Per-layer buffers [B, heads, capacity, d] holding every row's cache, right-aligned.

        ``shapes`` is (heads, d) per layer, the same for every layer. The buffers are views of
        one tensor [layers, 2, B, heads, capacity, d], so each row's whole cache goes in with one
        copy. Cached columns left of a shorter row are zeroed (padding is masked, and must never
        be NaN); the feed and decode columns are written by the forwards.
        """
        heads, dim = _uniform(shapes)
        c_max = self.cached_width
        size = (len(shapes), 2, self.rows, heads, self.capacity, dim)
        whole = torch.empty(size, dtype=dtype, device=device)
        if min(self.cached) < c_max:  # one memset beats a small zeroing per row
            whole[..., :c_max, :].zero_()
        for row, cache in enumerate(caches):
            if self.cached[row] and cache.kv is not None:
                whole[:, :, row, :, c_max - self.cached[row] : c_max] = cache.kv
        return [LayerBuffer(layer[0], layer[1], c_max, whole) for layer in whole.unbind(0)]

    def scatter(
        self, buffers: Sequence[LayerBuffer], row: int, steps_kept: int, keep_cached: bool = True
    ) -> SequenceCache:
        """Row ``row``'s new cache: its cached (unless not ``keep_cached``), fed and first
        ``steps_kept`` decoded columns, as one compact tensor of its own."""
        c_max, f_max = self.cached_width, self.fed_width
        first = c_max - self.cached[row] if keep_cached else c_max
        whole = _whole(buffers)[:, :, row]  # [layers, 2, heads, capacity, d]
        if self.fed[row] == f_max or steps_kept == 0:  # one run of columns: a slice
            stop = c_max + self.fed[row] + (steps_kept if self.fed[row] == f_max else 0)
            return SequenceCache(whole[:, :, :, first:stop].clone())
        device = whole.device  # (an index on another device than the cache is refused)
        keep = torch.cat(
            [
                torch.arange(first, c_max + self.fed[row], device=device),
                torch.arange(c_max + f_max, c_max + f_max + steps_kept, device=device),
            ]
        )
        return SequenceCache(whole.index_select(3, keep))


def _uniform(shapes: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The one (heads, d) of every layer."""
    if len(set(shapes)) != 1:
        raise ValueError(f"layers of different shapes are not supported: {sorted(set(shapes))}")
    return shapes[0]


def _whole(buffers: Sequence[LayerBuffer]) -> torch.Tensor:
    """The tensor [layers, 2, B, heads, capacity, d] that :meth:`RaggedBatch.gather`'s
    buffers are views of (stacked anew for buffers made elsewhere)."""
    if buffers[0].whole is not None:
        return buffers[0].whole
    return torch.stack([torch.stack([b.keys, b.values]) for b in buffers])
