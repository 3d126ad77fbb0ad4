"""Batched verification on the target: one forward for many sequences, each judged on its own.

Layers: the torch backend's ragged forward against one-row forwards; verify_batch / step_batch
against one sequence at a time (greedy token for token, sampled draw for draw with the row's own
generator); the law of batched rejection sampling (chi-square); the batcher that gathers the
sequences in flight into one forward.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from greedy import assert_greedy
from procs import ENV, REPO, HubProcess, TargetProcess, reference
from scipy import stats
from tiny_models import build_pair

from edge import batcher as batcher_module
from edge import verifier
from edge.backends import BackendUnavailable, load_backend
from edge.backends.torch import TorchBackend
from edge.batcher import Batcher
from edge.engine import Engine
from edge.verifier import TargetSequence, step_batch, verify_batch
from scripts.bench.harness import write_prompts
from starsd import models, sampling
from starsd.protocol import SamplingParams

GREEDY = SamplingParams()
# Different lengths: every row of a batch has its own cached length (left padding in the batch).
PROMPTS = [[5, 17, 33, 8], [9], [40, 41, 42, 43, 44, 45, 46, 47, 48], [3, 99, 7]]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def backend(
    request: pytest.FixtureRequest, llama_pair: tuple[Path, Path], gpt2_pair: tuple[Path, Path]
) -> TorchBackend:
    pair = {"llama": llama_pair, "gpt2": gpt2_pair}[request.param]
    return TorchBackend.load(pair[0])


def _alone(backend: TorchBackend, prompt: list[int], n: int) -> list[int]:
    seq = TargetSequence(backend, prompt, GREEDY, n)
    while not seq.done:  # one forward per token, the sequence alone
        seq.step()
    return seq.generated


# ------------------------------------------------------------------------------ the backend


def test_a_ragged_forward_equals_each_row_alone(backend: TorchBackend) -> None:
    """Catches a gather/scatter that misplaces a row's cache (wrong padding side, positions
    shifted by the padding, a padding query's NaN leaking into real rows): the batched logits,
    features and caches must equal one-row forwards within float tolerance."""
    caches, feeds = [], [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
    for prompt in PROMPTS:
        (out,) = backend.forward([verifier.SequenceCache()], [prompt])
        caches.append(out.cache)
    batched = backend.forward(caches, feeds, taps=(-1,))
    for cache, feed, row in zip(caches, feeds, batched, strict=True):
        (alone,) = backend.forward([cache], [feed], taps=(-1,))
        assert row.logits.shape == (len(feed), backend.info.vocab_size)
        assert torch.isfinite(row.logits).all()
        torch.testing.assert_close(row.logits, alone.logits, atol=1e-4, rtol=1e-4)
        assert row.features is not None and alone.features is not None
        torch.testing.assert_close(row.features, alone.features, atol=1e-4, rtol=1e-4)
        assert row.cache.length == cache.length + len(feed)
        for (k, v), (k1, v1) in zip(row.cache.layers, alone.cache.layers, strict=True):
            torch.testing.assert_close(k, k1, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v, v1, atol=1e-4, rtol=1e-4)
    assert [c.length for c in caches] == [len(p) for p in PROMPTS]  # the inputs are untouched


# ------------------------------------------------------------------------------ greedy


def test_batched_greedy_rounds_equal_the_target_alone(backend: TorchBackend) -> None:
    """Catches a per-row rollback bug (cache cropped to another row's accepted length, features
    kept for rejected drafts) and judging a row with a batch mate's logits: rows of different
    lengths and gammas, with every kind of outcome (all accepted, some, none, gamma 0), are
    verified together round after round and must produce exactly the target alone's tokens."""
    n = 20
    refs = [_alone(backend, p, n) for p in PROMPTS]
    seqs = [TargetSequence(backend, p, GREEDY, n, taps=(-1,)) for p in PROMPTS]
    one_by_one = [TargetSequence(backend, p, GREEDY, n) for p in PROMPTS]
    outcomes: set[int] = set()
    for rnd in range(n):
        rows, singles = [], []
        for i, (seq, single) in enumerate(zip(seqs, one_by_one, strict=True)):
            if seq.done:
                continue
            drafts = _drafts(refs[i], len(seq.generated), gamma=(i + rnd) % 5, wrong_at=rnd % 4)
            rows.append((seq, drafts, None))
            singles.append((single, drafts))
        if not rows:
            break
        results = verify_batch(backend, rows)
        for (single, drafts), result in zip(singles, results, strict=True):
            assert single.verify(drafts, None) == result  # the same proposal verified alone
            outcomes.add(result[0] - len(drafts))  # 0: all accepted, < 0: rejected
    for seq, single, ref in zip(seqs, one_by_one, refs, strict=True):
        assert seq.generated == ref == single.generated
        assert len(seq.feature_rows) == seq.committed - 1 or seq.done
    assert 0 in outcomes and min(outcomes) < 0


def _drafts(ref: list[int], at: int, gamma: int, wrong_at: int) -> list[int]:
    """The target's own next ``gamma`` tokens, the one at ``wrong_at`` replaced (if inside)."""
    drafts = list(ref[at : at + gamma])
    if wrong_at < len(drafts):
        drafts[wrong_at] = (drafts[wrong_at] + 1) % 300
    return drafts


def test_batched_steps_equal_the_target_alone(backend: TorchBackend) -> None:
    """Catches standalone steps that mix rows up (the --standalone --concurrency path)."""
    seqs = [TargetSequence(backend, p, GREEDY, 12) for p in PROMPTS]
    while not all(s.done for s in seqs):
        step_batch(backend, [s for s in seqs if not s.done])
    assert [s.generated for s in seqs] == [_alone(backend, p, 12) for p in PROMPTS]


def test_batched_prefill_keeps_the_features_a_single_prefill_keeps(backend: TorchBackend) -> None:
    """Catches a batched prefill that keeps padding rows as features (an EAGLE hub would
    draft from garbage) or skips a row."""
    batched = [TargetSequence(backend, p, GREEDY, 4, taps=(-1,), prefill=False) for p in PROMPTS]
    verifier.prefill_batch(backend, batched)
    for seq, prompt in zip(batched, PROMPTS, strict=True):
        alone = TargetSequence(backend, prompt, GREEDY, 4, taps=(-1,))
        assert seq.cached == len(prompt) - 1
        torch.testing.assert_close(
            seq.features(0, len(prompt) - 1).astype("float32"),
            alone.features(0, len(prompt) - 1).astype("float32"),
            atol=2e-3,
            rtol=2e-3,
        )


def test_a_bad_row_is_refused_before_any_forward(backend: TorchBackend) -> None:
    """Catches a proposal that would crash the model mid-batch (a token outside the vocabulary,
    a sampled proposal without q) instead of a clear ValueError; a duplicate row too."""
    seq = TargetSequence(backend, PROMPTS[0], GREEDY, 8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_batch(backend, [(seq, [backend.info.vocab_size], None)])
    sampled = TargetSequence(backend, PROMPTS[0], SamplingParams(1.0, seed=1), 8)
    with pytest.raises(ValueError, match="q probabilities"):
        verify_batch(backend, [(sampled, [3, 4], None)])
    with pytest.raises(ValueError, match="twice"):
        verify_batch(backend, [(seq, [3], None), (seq, [4], None)])
    assert seq.generated == [] and seq.cached == len(PROMPTS[0]) - 1  # nothing committed


# ------------------------------------------------------------------------------ sampled


def _q(vocab: int, gamma: int, seed: int) -> tuple[list[int], torch.Tensor]:
    """Drafts drawn from a random q [gamma, V] (its own generator)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(gamma, vocab, generator=gen) * 3, dim=-1)
    return sampling.sample(q, gen).tolist(), q


def test_a_sampled_row_draws_the_same_alone_and_in_a_batch(backend: TorchBackend) -> None:
    """Catches rows sharing one generator (a row's draws would depend on its batch mates and
    seeded outputs on the batch composition) or judged with another row's temperature."""
    vocab = backend.info.vocab_size
    params = [
        SamplingParams(0.8, 20, 0.95, 7),
        GREEDY,
        SamplingParams(1.3, 0, 1.0, 8),
        SamplingParams(1.0, 5, 1.0, 9),
    ]
    for rnd in range(3):
        proposals = [_q(vocab, gamma=1 + (i + rnd) % 4, seed=10 * rnd + i) for i in range(4)]
        batch = [TargetSequence(backend, p, s, 16) for p, s in zip(PROMPTS, params, strict=True)]
        alone = [TargetSequence(backend, p, s, 16) for p, s in zip(PROMPTS, params, strict=True)]
        for _ in range(3):
            rows = [
                (seq, d, None if seq.params.greedy else q)
                for seq, (d, q) in zip(batch, proposals, strict=True)
            ]
            together = verify_batch(backend, rows)
            separate = [
                seq.verify(d, None if seq.params.greedy else q)
                for seq, (d, q) in zip(alone, proposals, strict=True)
            ]
            assert together == separate
        assert [s.generated for s in batch] == [s.generated for s in alone]


def _first_token_counts(
    backend: TorchBackend, params: SamplingParams, trials: int, q: torch.Tensor
) -> torch.Tensor:
    """Counts [V] of the first emitted token over ``trials`` sampled sequences verified 50 at a
    time (with a longer greedy distractor row in every batch, so the counted rows are padded)."""
    vocab = backend.info.vocab_size
    counts = torch.zeros(vocab)
    gen = torch.Generator().manual_seed(1234)
    for start in range(0, trials, 50):
        # Not prefilled: the verify feeds the prompt and the drafts in one go (its logits rows
        # for the drafts are the last gamma + 1).
        seqs = [
            TargetSequence(backend, PROMPTS[0], replace_seed(params, start + i), 2, prefill=False)
            for i in range(min(50, trials - start))
        ]
        distractor = TargetSequence(backend, PROMPTS[2], GREEDY, 2)
        rows: list[verifier.VerifyRow] = [(distractor, [1, 2, 3], None)]
        for seq in seqs:
            rows.append((seq, sampling.sample(q, gen).tolist(), q))
        verify_batch(backend, rows)
        for seq in seqs:
            counts[seq.generated[0]] += 1
    return counts


def replace_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams(params.temperature, params.top_k, params.top_p, seed)


def _chi_square(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of ``counts`` [V] against the law ``expected`` [V] (cells under 5 lumped)."""
    trials = float(counts.sum())
    assert counts[expected == 0].sum() == 0, "a token the target never samples was emitted"
    big = expected * trials >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).double()
    exp = torch.cat([expected[big], expected[~big].sum()[None]]).double()
    keep = exp > 0
    exp = exp[keep] / exp[keep].sum() * trials
    return float(stats.chisquare(obs[keep].numpy(), exp.numpy()).pvalue)


@pytest.mark.parametrize("wrong", [False, True], ids=["residual", "no-residual"])
def test_batched_rejection_sampling_keeps_the_target_distribution(
    backend: TorchBackend, wrong: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first token of batched speculative sampling is distributed as p (chi-square). Catches
    a wrong residual (the classic bug: resampling from p instead of norm(max(p - q, 0))), which
    the ``no-residual`` case plants and must fail (p-value < 1e-6)."""
    params = SamplingParams(1.0, 20, 1.0, 0)
    (out,) = backend.forward(
        [TargetSequence(backend, PROMPTS[0], GREEDY, 2).cache], [[PROMPTS[0][-1]]]
    )
    p = sampling.probs_from_logits(out.logits[0], params)  # [V]
    support = torch.topk(p, 6).indices  # q favours a few of p's tokens: p - q is far from p
    q = torch.zeros(2, p.shape[0])
    q[:, support] = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.02])
    if wrong:
        monkeypatch.setattr(sampling, "residual_distribution", lambda p_, q_: p_)
    counts = _first_token_counts(backend, params, 2000, q)
    p_value = _chi_square(counts, p)
    assert (p_value < 1e-6) if wrong else (p_value > 1e-3), p_value


# ------------------------------------------------------------------------------ the batcher


async def test_the_batcher_runs_concurrent_sequences_in_shared_forwards(
    backend: TorchBackend,
) -> None:
    """Catches a batcher that runs one row per forward (no batching), mixes prefills into
    decoding rows, or loses a sequence; the outputs must still equal the target alone."""
    async with Batcher(backend, max_batch=8) as batcher:
        engine = Engine(backend, batcher)
        seqs = [engine.new_sequence(p, GREEDY, 12) for p in PROMPTS]
        await asyncio.gather(*(engine.run(s) for s in seqs))
    assert [s.generated for s in seqs] == [_alone(backend, p, 12) for p in PROMPTS]
    assert batcher.stats.max_rows == len(PROMPTS) and batcher.stats.mean_rows > 2.0
    # one-token prompts have nothing to prefill: no row of theirs in any forward
    assert batcher.stats.rows_by_kind["prefill"] == sum(len(p) > 1 for p in PROMPTS)


async def test_max_batch_caps_rows_per_forward(backend: TorchBackend) -> None:
    """Catches --max-batch being ignored (a Jetson's memory bound)."""
    async with Batcher(backend, max_batch=3) as batcher:
        engine = Engine(backend, batcher)
        seqs = [engine.new_sequence(p, GREEDY, 6) for p in PROMPTS * 2]
        await asyncio.gather(*(engine.run(s) for s in seqs))
    assert batcher.stats.max_rows == 3
    with pytest.raises(ValueError, match="max_batch"):
        Batcher(backend, max_batch=0)


async def test_a_sequence_that_starts_out_of_step_joins_its_batch_mates(
    backend: TorchBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a batcher that takes the next batch before the sequences it just answered have
    queued their next step: a sequence started during another's forward (as a new request's
    does after its prefill, standalone at --concurrency 8 with more prompts than slots) then
    alternates with it for good, one forward each (measured: 420 forwards of 4.0 rows for 16
    prompts against 129 of 7.1 for 8)."""

    async def decode(seq: TargetSequence) -> None:
        while not seq.done:
            await batcher.step(seq)

    def slow_compute(*args: object) -> object:  # forwards long enough for b to start in one
        time.sleep(0.005)
        return compute(*args)

    compute = batcher_module.compute
    monkeypatch.setattr(batcher_module, "compute", slow_compute)
    steps = 24
    async with Batcher(backend, max_batch=8) as batcher:
        a, b = (TargetSequence(backend, p, GREEDY, steps) for p in PROMPTS[:2])
        first = asyncio.ensure_future(decode(a))
        while not batcher._pending:  # a's first step is queued ...
            await asyncio.sleep(0)
        while batcher._pending:  # ... and taken into a forward: b starts during it
            await asyncio.sleep(0)
        await asyncio.gather(first, decode(b))
    assert a.generated == _alone(backend, PROMPTS[0], steps)
    assert batcher.stats.forwards <= steps + 2  # they merged at once: not 2 x steps


async def test_a_sequences_forward_clocks_split_its_own_forwards_from_the_others(
    backend: TorchBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches the times a DRAFT reports counted wrong. Draft.others_us: a forward of other
    rows, or another sequence's prefill, left out (a round that waited out either was priced
    as its gamma's cost, and a target's sessions went alone where drafting paid), the
    sequence's own forward counted in it, or the forward running when the proposal arrived
    missed (the sequence waits out the rest of it). Draft.forward_us: forwards that did not
    carry the sequence counted in its mean."""

    def slow_compute(backend: TorchBackend, batch: list) -> object:
        carries_a = any(item.seq is a for item in batch)
        prefill = batch[0].kind == batcher_module.PREFILL
        time.sleep(0.03 if prefill else 0.06 if carries_a else 0.01)
        return compute(backend, batch)

    compute = batcher_module.compute
    monkeypatch.setattr(batcher_module, "compute", slow_compute)
    async with Batcher(backend, max_batch=8) as batcher:
        engine = Engine(backend, batcher)
        a, b, c = (engine.new_sequence(p, GREEDY, 8) for p in PROMPTS[:3])
        await asyncio.gather(batcher.prefill(a), batcher.prefill(b))
        mark = batcher.mark(a)
        await batcher.step(b)  # a row out of step with a's: a waits it out
        await asyncio.gather(batcher.step(a), batcher.step(b))  # one forward carries both
        others, own = batcher.forwards_since(a, mark)
        assert 0.01 <= others < 0.06 and own >= 0.06  # a's own forward in others: >= 0.07
        prefill_c = asyncio.ensure_future(batcher.prefill(c))
        while batcher._busy_from is None:  # c's prefill is running ...
            await asyncio.sleep(0.001)
        started = batcher._busy_from
        await asyncio.sleep(0.015)
        mark = batcher.mark(a)  # ... a's proposal arrives at least 15 ms into it ...
        await prefill_c
        others, own = batcher.forwards_since(a, mark)
        whole = time.perf_counter() - started  # the prefill's length, bounded from above
        # ... and waits out the rest, not all of it (the real prefill's own compute adds to the
        # 30 ms sleep by a machine-dependent amount, hence bounds from the measured forward)
        assert 0.0 < others <= whole - 0.015 and own == 0.0


async def _learn_round_trip(batcher: Batcher, seq: TargetSequence, r: float) -> None:
    """``seq``'s proposals come back ``r`` seconds after its DRAFT; its DRAFT is out now."""
    await batcher.verify(seq, [], None)
    await asyncio.sleep(r)
    await batcher.verify(seq, [], None)


@pytest.mark.parametrize("gather", [True, False])
async def test_a_proposal_due_shortly_joins_the_forward(
    backend: TorchBackend, gather: bool
) -> None:
    """Catches a batcher that verifies whatever waits the moment the model thread is free, so
    a target's sequences split into groups that take turns (half the rows per forward, twice
    the forwards: measured at --concurrency 8 through a hub), and one that waits for a
    sequence that is not coming: a proposal due within one forward's time is waited for, an
    overdue one is not."""
    async with Batcher(backend, max_batch=8, gather=gather) as batcher:
        a, b, late = (TargetSequence(backend, p, GREEDY, 50) for p in PROMPTS[:3])
        await _learn_round_trip(batcher, late, 0.02)  # (its next proposal will never come)
        await asyncio.sleep(0.02)  # ... and is overdue before B's forward is gathered
        await _learn_round_trip(batcher, a, 0.02)  # A's proposals come back 20 ms later
        batcher.forward_s = 0.5  # the window: generous, so a slow machine cannot flake
        forwards = batcher.stats.forwards
        started = asyncio.get_running_loop().time()
        b_done = asyncio.ensure_future(batcher.verify(b, [], None))
        await asyncio.sleep(0.01)  # B waits (gathering) for A, due back 20 ms after its DRAFT
        await asyncio.sleep(0.01)
        await asyncio.gather(b_done, batcher.verify(a, [], None))
        took = asyncio.get_running_loop().time() - started
    assert batcher.stats.forwards - forwards == (1 if gather else 2)
    assert took < 0.4  # late (overdue after 0.25 R) was not waited for: not the whole window


async def test_a_due_proposal_running_late_still_joins_the_forward(backend: TorchBackend) -> None:
    """Catches a batcher that stops waiting for a due proposal once it runs later than its
    round trip predicts (the wait ended 1 ms after the latest predicted return): a hub's
    round trips spread by more than that, and a forward started without the late proposal
    costs its sequence the whole forward, after which the batch splits into groups that take
    turns (measured at --concurrency 8 through a hub: 5.7 rows a forward, and 6.2 once late
    proposals were waited for)."""
    async with Batcher(backend, max_batch=8) as batcher:
        a, b = (TargetSequence(backend, p, GREEDY, 50) for p in PROMPTS[:2])
        await _learn_round_trip(batcher, a, 0.02)
        batcher.forward_s = 0.5  # the window: generous, so a slow machine cannot flake
        forwards = batcher.stats.forwards
        b_done = asyncio.ensure_future(batcher.verify(b, [], None))
        await asyncio.sleep(0.06)  # A's proposal comes back 40 ms later than its R says
        await asyncio.gather(b_done, batcher.verify(a, [], None))
    assert batcher.stats.forwards - forwards == 1


async def test_a_due_proposal_that_never_comes_holds_a_forward_one_window_at_most(
    backend: TorchBackend,
) -> None:
    """Catches a wait for a due proposal with no end (a hub that stopped answering would stop
    the target's other sequences) and one that does not wait at all."""
    async with Batcher(backend, max_batch=8) as batcher:
        a, b = (TargetSequence(backend, p, GREEDY, 50) for p in PROMPTS[:2])
        await _learn_round_trip(batcher, a, 0.02)  # A's next proposal never comes
        batcher.forward_s = 0.1
        started = asyncio.get_running_loop().time()
        await batcher.verify(b, [], None)
        took = asyncio.get_running_loop().time() - started
    assert 0.09 <= took < 1.0


async def test_a_released_sequences_proposal_is_not_waited_for(backend: TorchBackend) -> None:
    """Catches a batcher that still waits for the proposal of a sequence that ended or was
    cancelled with its DRAFT out (a client gone mid-request): the window, at every forward
    until that proposal would have been overdue."""
    async with Batcher(backend, max_batch=8) as batcher:
        a, b = (TargetSequence(backend, p, GREEDY, 50) for p in PROMPTS[:2])
        await _learn_round_trip(batcher, a, 0.02)
        batcher.release(a)
        batcher.forward_s = 0.5
        started = asyncio.get_running_loop().time()
        await batcher.verify(b, [], None)
        took = asyncio.get_running_loop().time() - started
    assert took < 0.4


async def test_a_bad_or_cancelled_sequence_does_not_disturb_its_batch_mates(
    backend: TorchBackend,
) -> None:
    """Catches one bad proposal failing the whole batch, and a cancelled sequence (a client
    that went away) leaving its work behind to stall or corrupt the others; streamed tokens
    (on_tokens) must add up to the output."""
    streamed: list[int] = []
    async with Batcher(backend) as batcher:
        engine = Engine(backend, batcher)
        good = [engine.new_sequence(p, GREEDY, 15) for p in PROMPTS[:3]]
        victim = engine.new_sequence(PROMPTS[3], GREEDY, 200)  # would outlast the others
        tasks = [asyncio.create_task(engine.run(s)) for s in good[1:]]
        tasks.append(asyncio.create_task(engine.run(good[0], on_tokens=streamed.extend)))
        doomed = asyncio.create_task(engine.run(victim))
        bad = TargetSequence(backend, PROMPTS[0], GREEDY, 5)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await batcher.verify(bad, [10**6], None)
        while len(victim.generated) < 2:
            await asyncio.sleep(0.001)
        doomed.cancel()
        await asyncio.gather(*tasks)
        assert doomed.cancelled() and len(victim.generated) < 30
    assert [s.generated for s in good] == [_alone(backend, p, 15) for p in PROMPTS[:3]]
    assert streamed == good[0].generated


def test_backends_load_lazily_and_an_absent_one_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, llama_pair: tuple[Path, Path]
) -> None:
    """Catches the factory importing every backend (transformers on a slim install) or an
    ImportError traceback for a backend that is not there."""
    probe = (
        "import sys, edge.target, edge.engine, edge.backends; "
        "print('transformers' in sys.modules, 'edge.backends.torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=REPO,
        timeout=120,
        check=True,
    ).stdout
    assert out.split() == ["False", "False"], out
    monkeypatch.setitem(sys.modules, "edge.backends.onnxruntime", None)
    with pytest.raises(BackendUnavailable, match="onnxruntime backend is not available"):
        load_backend("onnxruntime", llama_pair[0])
    with pytest.raises(ValueError, match="unknown backend"):
        load_backend("tensorflow", llama_pair[0])
    loaded = load_backend("torch", llama_pair[0])
    assert loaded.info.vocab_size == models.load_causal_lm(llama_pair[0]).vocab_size


# ------------------------------------------------------------------------------ end to end

E2E_PROMPTS = [
    "To be, or not to be",
    "Now is the winter",
    "All the world",
    "O",
    "the slings and arrows of",
    "whether tis nobler",
]


def _rows_per_forward(log: str) -> float:
    found = re.search(r"mean rows per forward ([0-9.]+)", log)
    assert found, log[-3000:]
    return float(found.group(1))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_one_target_at_concurrency_4_batches_and_equals_the_target_alone(
    family: str, tmp_path: Path
) -> None:
    """A real hub and one ``edge.target --concurrency 4`` process (greedy), then the same target
    ``--standalone --concurrency 4``: both outputs equal transformers' ``generate()`` token for
    token, and both batched (mean rows per forward > 1). Catches batching that changes the
    output (rows mixed up, rollback of the wrong row) or that never happens (a batcher that
    serialises, a --concurrency that is not wired to it)."""
    target_dir, draft_dir = build_pair(tmp_path, family)
    prompts = write_prompts(tmp_path / "in.jsonl", E2E_PROMPTS)
    hub = HubProcess(draft_dir, tmp_path / "hub.log")
    try:
        spec = TargetProcess(
            hub.endpoint,
            target_dir,
            prompts,
            tmp_path / "spec.jsonl",
            "--concurrency",
            "4",
            "--deadline-ms",
            "60000",
        )
        rows = spec.wait()
    finally:
        hub.stop()
    alone = TargetProcess(
        hub.endpoint,
        target_dir,
        prompts,
        tmp_path / "alone.jsonl",
        "--concurrency",
        "4",
        "--standalone",
    )
    alone_rows = alone.wait()
    for row, alone_row, prompt in zip(rows, alone_rows, E2E_PROMPTS, strict=True):
        ref = reference(target_dir, prompt, 24)
        assert row["token_ids"] == ref == alone_row["token_ids"], prompt
    assert sum(r["stats"]["rounds"] for r in rows) > 0  # the hub's proposals were verified
    assert _rows_per_forward(spec.text()) > 1.0
    assert _rows_per_forward(alone.text()) > 2.0


@pytest.mark.slow
def test_the_onnxruntime_backend_through_a_hub_at_concurrency_4_equals_generate(
    tmp_path: Path,
) -> None:
    """``edge.target --backend onnxruntime`` (CPU provider, float32) speculating through a real
    hub with 4 sequences batched: greedy output equals transformers' ``generate()`` token for
    token. Catches the backend flag not reaching the factory, and an ONNX Runtime backend that
    is exact alone but not on ragged verification batches with rollback."""
    pytest.importorskip("onnxruntime")
    from edge import export as exporter

    target_dir, draft_dir = build_pair(tmp_path, "llama")
    exporter.export(target_dir, tmp_path / "onnx")
    prompts = write_prompts(tmp_path / "in.jsonl", E2E_PROMPTS[:4])
    hub = HubProcess(draft_dir, tmp_path / "hub.log")
    try:
        spec = TargetProcess(
            hub.endpoint,
            tmp_path / "onnx",
            prompts,
            tmp_path / "out.jsonl",
            "--concurrency",
            "4",
            "--deadline-ms",
            "60000",
            "--backend",
            "onnxruntime",
        )
        rows = spec.wait()
    finally:
        hub.stop()
    for row, prompt in zip(rows, E2E_PROMPTS[:4], strict=True):
        assert_greedy(target_dir, prompt, row["token_ids"], reference(target_dir, prompt, 24))
    assert sum(r["stats"]["rounds"] for r in rows) > 0
    assert _rows_per_forward(spec.text()) > 1.0
