"""One KV tensor for a target's sequences in flight (starsd/kvpool.py), and the torch backend's
pooled forward over it."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest
import torch

from starsd import models
from starsd.batch import ROW_CHUNK, SequenceCache
from starsd.kvpool import KVPool, PooledRows

SHAPE = (2, 3, 4)  # layers, kv heads, head dim
CPU = torch.device("cpu")


def _pool() -> KVPool:
    return KVPool(SHAPE, torch.float32, CPU)


def _compact(length: int, fill: float) -> SequenceCache:
    return SequenceCache(torch.full((2, 2, 3, length, 4), fill))


def test_a_cache_is_copied_into_its_slot_once_and_then_viewed() -> None:
    """Catches a pooled cache copied again on every forward (the cost the pool exists to
    avoid), or a copy that loses or misplaces the compact cache's positions."""
    pool = _pool()
    first = pool.adopt(_compact(5, 1.0), room=3)
    assert first.length == 5 and first.kv is not None and first.kv.eq(1.0).all()
    assert pool.capacity == ROW_CHUNK and pool.in_use == 1
    again = pool.adopt(first, room=3)
    assert again is first and pool.in_use == 1  # already in the pool: itself, no copy


def test_growth_keeps_every_live_view_and_its_positions() -> None:
    """Catches a pool that grows (more slots, longer capacity) but leaves live caches viewing the
    old tensor: their positions would silently stop being written and read."""
    pool = _pool()
    caches = [pool.adopt(_compact(4, float(i)), room=1) for i in range(3)]  # 3 slots
    assert pool.slots >= 3
    longer = pool.adopt(caches[0], room=ROW_CHUNK)  # capacity must grow past one chunk
    assert pool.capacity == 2 * ROW_CHUNK
    for i, cache in enumerate(caches):
        assert cache.kv is not None and cache.store is not None
        assert cache.kv.eq(float(i)).all() and cache.store.shape[3] == pool.capacity
        assert cache.kv.untyped_storage().data_ptr() == pool.whole.untyped_storage().data_ptr()
    assert longer.length == 4


def test_a_slot_returns_when_its_last_view_is_gone_and_the_lowest_is_reused() -> None:
    """Catches slots that leak (a server's pool would grow with every request), a slot reused
    while a view of it lives, or memory kept after the last sequence ends."""
    pool = _pool()
    a = pool.adopt(_compact(2, 1.0), room=1)
    b = pool.adopt(_compact(2, 2.0), room=1)
    b_slot = pool.slot_of(b).index  # type: ignore[union-attr]
    b_view = pool.view(pool.slot_of(b), 1)  # type: ignore[arg-type]
    del b
    gc.collect()
    assert pool.in_use == 2  # b_view still holds the slot
    del b_view
    gc.collect()
    assert pool.in_use == 1
    c = pool.adopt(_compact(2, 3.0), room=1)
    assert pool.slot_of(c).index == b_slot  # type: ignore[union-attr]
    assert a.kv is not None and a.kv.eq(1.0).all()
    del a, c
    gc.collect()
    assert pool.in_use == 0 and pool.whole is None


def test_releasing_from_another_thread_while_the_model_thread_grows_the_pool() -> None:
    """Catches a deadlock or a lost slot when caches die in one thread (the event loop drops a
    finished sequence) while another adopts and grows (the model thread)."""
    pool = _pool()
    doomed = [pool.adopt(_compact(3, 0.0), room=1) for _ in range(8)]
    done = threading.Event()

    def drop() -> None:
        while doomed:
            doomed.pop()
        done.set()

    thread = threading.Thread(target=drop)
    thread.start()
    kept = [pool.adopt(_compact(3, 1.0), room=ROW_CHUNK * (i % 3)) for i in range(8)]
    thread.join(timeout=10)
    gc.collect()
    assert done.is_set() and pool.in_use == len(kept)
    assert all(k.kv is not None and k.kv.eq(1.0).all() for k in kept)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense-range", "sparse-rows"])
def test_pooled_forward_equals_the_gather_path(
    sparse: bool,
    llama_pair: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches the pooled attention with a wrong causal or range mask (a feed token seeing
    later feed tokens, a row seeing a neighbouring slot), keys written at the wrong positions,
    or a sparse batch (one attention per row) disagreeing with a dense one (one per layer):
    logits and caches must equal the gather path's (the plain-torch Llama; other
    architectures keep transformers' attention and the gather path)."""
    from edge.backends.torch import TorchBackend

    backend = TorchBackend(models.load_causal_lm(llama_pair[0]))
    pool = backend.pool
    assert pool is not None
    prompts = [[5, 17, 33, 8, 9], [1], list(range(40, 52)), [6, 7], [2, 3, 4]]
    caches = [o.cache for o in backend.forward([SequenceCache()] * 5, prompts)]
    feeds = [[3, 4, 5, 6], [7], [8, 9], [10], [11, 12]]
    pick = [0, 2, 4]  # slots 0, 2 and 4: a range of 5 for 3 rows
    each = 0
    attend_each = PooledRows._attend_each

    def counted(self: PooledRows, *args: object) -> torch.Tensor:
        nonlocal each
        each += 1
        return attend_each(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(PooledRows, "_attend_each", counted)
    monkeypatch.setattr("starsd.kvpool.DENSE_SLOTS_PER_ROW", 0 if sparse else 2)
    pooled = backend.forward([caches[i] for i in pick], [feeds[i] for i in pick])
    assert (each > 0) == sparse  # (the path named ran)
    backend.pool = None  # the same rows through the gather path
    padded = backend.forward(
        [SequenceCache(c.kv) for c in (caches[i] for i in pick)], [feeds[i] for i in pick]
    )
    for n, i in enumerate(pick):
        mine, theirs = pooled[n], padded[n]
        torch.testing.assert_close(mine.logits, theirs.logits, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(mine.cache.kv, theirs.cache.kv, atol=1e-5, rtol=1e-4)
        assert caches[i].length + len(feeds[i]) == mine.cache.length
        assert mine.cache.store is not None  # (it stayed in the pool)
