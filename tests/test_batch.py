"""The ragged batch layout (starsd/batch.py) and the batched forward over it (models.py)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from starsd import models
from starsd.batch import RaggedBatch, SequenceCache
from starsd.llama import PaddedKeyValues


def test_layout_of_a_ragged_batch() -> None:
    """Catches an off-by-one in where a row's cached, fed and decoded columns sit."""
    batch = RaggedBatch(cached=(2, 0, 3), fed=(1, 3, 2), steps=2)
    assert (batch.cached_width, batch.fed_width, batch.capacity) == (3, 3, 8)
    assert batch.key_mask(8).tolist() == [
        [0, 1, 1, 1, 0, 0, 1, 1],
        [0, 0, 0, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 0, 1, 1],
    ]
    assert batch.feed_positions().tolist() == [[2, 2, 2], [0, 1, 2], [3, 4, 4]]
    assert batch.step_positions(1).flatten().tolist() == [4, 4, 6]
    assert batch.last_fed().tolist() == [0, 2, 1]
    assert batch.input_ids([[7], [1, 2, 3], [4, 5]], pad=9).tolist() == [
        [7, 9, 9],
        [1, 2, 3],
        [4, 5, 9],
    ]


@pytest.mark.parametrize("cached, fed", [((0,), (0,)), ((1,), (-1,)), ((1, 2), (1,))])
def test_a_row_without_keys_is_refused(cached: tuple, fed: tuple) -> None:
    """Catches a batch whose padding queries would see no key at all (a NaN softmax)."""
    with pytest.raises(ValueError):
        RaggedBatch(cached, fed, 0)


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


def _filled(columns: int, value: float, device: str) -> torch.Tensor:
    """Keys or values a forward appends for 2 rows x 2 heads (width 4)."""
    return torch.full((2, 2, columns, 4), value, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_gather_then_scatter_gives_each_row_its_own_compact_cache(device: str) -> None:
    """Catches a scatter that keeps padding or another row's columns, or a view into the whole
    batch buffer (which would pin the batch's memory for as long as the session lives); on
    CUDA, a column index built on the CPU (index_select refuses it: a hub pre-drafting on a GPU
    lost its drafting thread to that)."""
    shapes = [(2, 4), (2, 4)]
    caches = [
        SequenceCache.from_layers(
            [
                (torch.randn(2, c, 4, device=device), torch.randn(2, c, 4, device=device))
                for _ in shapes
            ]
        )
        for c in (3, 1)
    ]
    batch = RaggedBatch((3, 1), (2, 1), steps=1)
    buffers = batch.gather(caches, shapes, torch.float32, torch.device(device))
    for b in buffers:  # what a forward would append: the feed, then one decode step
        b.append(_filled(2, 5.0, device), _filled(2, 6.0, device))
        b.append(_filled(1, 7.0, device), _filled(1, 8.0, device))
    row1 = batch.scatter(buffers, 1, steps_kept=1)
    assert row1.length == 1 + 1 + 1
    k, v = row1.layers[0]
    assert torch.equal(k[:, 0], caches[1].layers[0][0][:, 0])
    assert k[:, 1].eq(5).all() and k[:, 2].eq(7).all() and v[:, 2].eq(8).all()
    assert row1.kv is not None  # its own memory, not a view of the batch:
    assert row1.kv.untyped_storage().nbytes() == row1.kv.nbytes == row1.nbytes()
    assert batch.scatter(buffers, 0, steps_kept=0).length == 3 + 2
    row0 = batch.scatter(buffers, 0, steps_kept=1)  # a full-width feed: one run of columns
    k0 = row0.layers[1][0]
    assert row0.length == 3 + 2 + 1 and torch.equal(k0[:, :3], caches[0].layers[1][0])
    assert k0[:, 3:5].eq(5).all() and k0[:, 5].eq(7).all()
    assert batch.scatter(buffers, 1, steps_kept=1, keep_cached=False).length == 1 + 1


@pytest.mark.parametrize("lean", [True, False], ids=["plain-torch", "transformers"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_ragged_forward_equals_each_sequence_alone(
    family: str,
    lean: bool,
    llama_pair: tuple[Path, Path],
    gpt2_pair: tuple[Path, Path],
) -> None:
    """Catches wrong position ids, a mask that lets a row see padding or another row, and a
    cache layer that writes to the wrong columns (Llama: rotary positions; GPT-2: learned),
    in StarSD's own Llama forward and in transformers' (every other architecture's)."""
    draft = models.load_causal_lm({"llama": llama_pair, "gpt2": gpt2_pair}[family][1], lean=lean)
    shapes = models.kv_shapes(draft)
    seqs = [[5, 17, 33, 8, 9, 11, 40], [3, 4], [21, 22, 23, 24, 25]]
    split = [4, 0, 3]  # cached part of each sequence
    caches = []
    for seq, c in zip(seqs, split, strict=True):
        cache = SequenceCache()
        if c:
            first = RaggedBatch((0,), (c,), 0)
            buffers = first.gather([cache], shapes, torch.float32, draft.device)
            models.forward_batch(
                draft,
                first.input_ids([seq[:c]]),
                first.feed_positions(),
                PaddedKeyValues(buffers, first.key_mask(c)),
            )
            cache = first.scatter(buffers, 0, 0)
        caches.append(cache)
    fed = tuple(len(s) - c for s, c in zip(seqs, split, strict=True))
    batch = RaggedBatch(tuple(split), fed, 1)
    buffers = batch.gather(caches, shapes, torch.float32, draft.device)
    width = batch.cached_width + batch.fed_width
    feeds = [s[c:] for s, c in zip(seqs, split, strict=True)]
    logits, _ = models.forward_batch(
        draft,
        batch.input_ids(feeds),
        batch.feed_positions(),
        PaddedKeyValues(buffers, batch.key_mask(width)),
    )
    nxt = torch.tensor([[1], [2], [3]])
    step, _ = models.forward_batch(
        draft, nxt, batch.step_positions(0), PaddedKeyValues(buffers, batch.key_mask(width + 1))
    )
    for i, seq in enumerate(seqs):
        alone = models.forward(draft, [*seq, int(nxt[i])], models.new_cache(draft))
        real = logits[i, : len(feeds[i])]
        torch.testing.assert_close(real, alone[split[i] : len(seq)], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(step[i, 0], alone[-1], atol=1e-5, rtol=1e-4)


class _OldForward:
    """A forward with transformers' older name for the KV cache."""

    def forward(self, input_ids: object = None, past_key_values: object = None, **kwargs: object):
        raise NotImplementedError


def test_the_cache_goes_under_the_keyword_the_forward_takes(
    llama_pair: tuple[Path, Path],
) -> None:
    """Catches the cache passed as ``cache=`` to a transformers release whose forward calls it
    ``past_key_values``: its ``**kwargs`` swallow the unknown keyword and the cache stays empty
    (kv_shapes then fails; the verifier would re-read nothing)."""
    assert list(models.cache_arg(_OldForward(), "C")) == ["past_key_values"]
    loaded = models.load_causal_lm(llama_pair[0], lean=False)
    (keyword,) = models.cache_arg(loaded.model, "C")
    assert keyword in inspect.signature(type(loaded.model).forward).parameters
    assert len(models.kv_shapes(loaded)) == loaded.model.config.num_hidden_layers
