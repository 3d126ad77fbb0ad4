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
batches (measured by ``scripts/bench_service.py``), while a session keeps a compact tensor of its
own that a verdict crops with a slice.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [heads, T, d]


@dataclass
class SequenceCache:
    """One sequence's KV cache, owned by whoever owns the sequence (no batch dimension)."""

    layers: KV = field(default_factory=list)  # empty until the first forward

    @property
    def length(self) -> int:
        """Number of positions held."""
        return int(self.layers[0][0].shape[1]) if self.layers else 0

    def crop(self, length: int) -> None:
        """Keep exactly the first ``length`` positions (views: the next scatter copies anyway).

        Raises:
            ValueError: if ``length`` is negative or longer than the cache.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        self.layers = [(k[:, :length], v[:, :length]) for k, v in self.layers]

    def extended(self, more: SequenceCache) -> SequenceCache:
        """A new cache: these positions, then ``more``'s (copies both)."""
        if not self.layers:
            return SequenceCache(list(more.layers))
        return SequenceCache([(torch.cat([k, k2], dim=1), torch.cat([v, v2], dim=1))
                              for (k, v), (k2, v2) in zip(self.layers, more.layers,
                                                          strict=True)])  # fmt: skip

    def prefix(self, length: int) -> SequenceCache:
        """A view of the first ``length`` positions (this cache is left as it is)."""
        view = SequenceCache(list(self.layers))
        view.crop(length)
        return view

    def nbytes(self) -> int:
        """Bytes of keys and values this sequence holds."""
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


class LayerBuffer:
    """One layer's keys and values for a whole batch, preallocated; appends write in place."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, filled: int) -> None:
        self.keys = keys  # [B, heads, capacity, d]
        self.values = values  # [B, heads, capacity, d]
        self.filled = filled  # columns written so far

    def append(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
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

    @functools.cached_property
    def _cached(self) -> torch.Tensor:
        return torch.tensor(self.cached)  # [B]

    @functools.cached_property
    def _fed(self) -> torch.Tensor:
        return torch.tensor(self.fed)  # [B]

    def gather(self, caches: Sequence[SequenceCache], shapes: Sequence[tuple[int, int]],
               dtype: torch.dtype, device: torch.device) -> list[LayerBuffer]:  # fmt: skip
        """Per-layer buffers [B, heads, capacity, d] holding every row's cache, right-aligned.

        ``shapes`` is (heads, d) per layer. The cached columns are zeroed first (padding is
        masked, and must never be NaN); the feed and decode columns are written by the forwards.
        (A row-by-row copy: measured faster here than one concatenation plus an indexed write.)
        """
        c_max = self.cached_width
        buffers = []
        for layer, (heads, dim) in enumerate(shapes):
            size = (self.rows, heads, self.capacity, dim)
            keys = torch.empty(size, dtype=dtype, device=device)
            values = torch.empty(size, dtype=dtype, device=device)
            keys[:, :, :c_max].zero_()  # one memset beats a small zeroing per row
            values[:, :, :c_max].zero_()
            for row, cache in enumerate(caches):
                if self.cached[row]:
                    k, v = cache.layers[layer]  # [heads, c_i, d]
                    keys[row, :, c_max - self.cached[row] : c_max] = k
                    values[row, :, c_max - self.cached[row] : c_max] = v
            buffers.append(LayerBuffer(keys, values, c_max))
        return buffers

    def scatter(self, buffers: Sequence[LayerBuffer], row: int, steps_kept: int,
                keep_cached: bool = True) -> SequenceCache:  # fmt: skip
        """Row ``row``'s new cache: its cached (unless not ``keep_cached``), fed and first
        ``steps_kept`` decoded columns."""
        c_max, f_max = self.cached_width, self.fed_width
        first = c_max - self.cached[row] if keep_cached else c_max
        keep = torch.cat([
            torch.arange(first, c_max + self.fed[row]),
            torch.arange(c_max + f_max, c_max + f_max + steps_kept),
        ])  # fmt: skip
        return SequenceCache([(b.keys[row].index_select(1, keep),
                               b.values[row].index_select(1, keep)) for b in buffers])  # fmt: skip



# ---------------------------------------------------------------------- packed: one tensor per row


@dataclass
class PackedCache(SequenceCache):
    """A :class:`SequenceCache` whose layers are views of ONE tensor [layers, 2, heads, T, d].

    For models whose layers all have the same (heads, d): a batch then gathers and scatters a
    row with one copy instead of two per layer (a 20-layer model's 8-row verify spent about a
    third of its time in 640 small per-layer copies).
    """

    packed: torch.Tensor | None = None  # [layers, 2, heads, T, d]

    def crop(self, length: int) -> None:
        """Keep exactly the first ``length`` positions (views, like the base class)."""
        super().crop(length)
        if self.packed is not None:
            self.packed = self.packed[:, :, :, :length]


def packed_gather(batch: RaggedBatch, caches: Sequence[SequenceCache], shape: tuple[int, int],
                  layers: int, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, list[LayerBuffer]]:  # fmt: skip
    """Like :meth:`RaggedBatch.gather`, into one tensor [layers, 2, B, heads, capacity, d] (all
    layers of shape ``shape`` = (heads, d)); returns it and a :class:`LayerBuffer` view per layer.
    A :class:`PackedCache` row is copied in one op, any other row layer by layer."""
    heads, dim = shape
    c_max = batch.cached_width
    big = torch.empty((layers, 2, batch.rows, heads, batch.capacity, dim), dtype=dtype,
                      device=device)  # fmt: skip
    for row, cache in enumerate(caches):
        c = batch.cached[row]
        if c < c_max:  # left padding: masked, and must never be NaN
            big[:, :, row, :, : c_max - c].zero_()
        if not c:
            continue
        if isinstance(cache, PackedCache) and cache.packed is not None:
            big[:, :, row, :, c_max - c : c_max] = cache.packed
        else:
            for layer, (k, v) in enumerate(cache.layers):  # [heads, c, d] each
                big[layer, 0, row, :, c_max - c : c_max] = k
                big[layer, 1, row, :, c_max - c : c_max] = v
    return big, [LayerBuffer(big[n, 0], big[n, 1], c_max) for n in range(layers)]


def packed_scatter(batch: RaggedBatch, big: torch.Tensor, row: int) -> PackedCache:
    """Row ``row``'s new cache (its cached and fed columns) from :func:`packed_gather`'s tensor,
    copied once (a view when the batch has one row: no other row's columns are kept alive)."""
    c_max = batch.cached_width
    packed = big[:, :, row, :, c_max - batch.cached[row] : c_max + batch.fed[row]]
    if batch.rows > 1:
        packed = packed.clone()
    return PackedCache([(packed[n, 0], packed[n, 1]) for n in range(packed.shape[0])], packed)
