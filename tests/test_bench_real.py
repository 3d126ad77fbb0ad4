"""The real-pair benchmark's pure parts: the model's predictions and the proposal sizes."""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from edge import target
from edge.batcher import BatchStats
from edge.requests import Result
from scripts.bench import real, real_costs
from scripts.bench.real import predicted_for, predictions, proposal_bytes
from starsd.protocol import Proposal


def test_a_dense_q_at_the_real_vocabulary_costs_what_it_should_on_the_wire() -> None:
    """Catches q sent as float64, over the wrong axis, or for the bonus position too: 4 tokens
    of a dense float32 q over 49152 ids are 786,432 bytes, top-k 50 a few hundred more than
    the ids and their q, greedy only the ids."""
    sizes = proposal_bytes(4, 49152, 50)
    assert 4 * 49152 * 4 <= sizes["dense"] < 4 * 49152 * 4 + 512
    assert 4 * 50 * 8 <= sizes["top_k"] < 4 * 50 * 8 + 512
    assert sizes["greedy"] < 256


def test_the_model_predicts_auto_as_the_best_of_alone_and_every_gamma() -> None:
    """Catches a prediction that ignores decoding alone (auto below 1x where no gamma pays) or
    prices a round without its draft time."""
    step = 0.070
    runs = {
        "central-g1": {"mean_accepted": 0.4, "draft_s": 0.010, "verify_s": 0.120},
        "central-g2": {"mean_accepted": 0.6, "draft_s": 0.020, "verify_s": 0.150},
        "central-g4": {"mean_accepted": 0.7, "draft_s": 0.040, "verify_s": 0.160},
    }
    pred = predictions(runs, step)
    assert pred["g1"] == pytest.approx(1.4 * 0.070 / 0.130)
    assert pred["auto"] == 1.0
    runs["central-g1"]["verify_s"] = 0.050  # a memory-bound target: verify ~ a step
    assert predictions(runs, step)["auto"] == pytest.approx(1.4 * 0.070 / 0.060)


def _costs(step: float, verify: dict[int, float], draft: dict[int, float]) -> dict:
    """Batched costs in the benchmark's JSON layout, alike at every B of 1, 3, 4, 8."""
    sizes = ("1", "3", "4", "8")
    return {
        "step_ms": dict.fromkeys(sizes, step),
        "verify_ms": {b: {str(g): v for g, v in verify.items()} for b in sizes},
        "draft_ms": {b: {str(g): d for g, d in draft.items()} for b in sizes},
    }


def test_a_batched_target_is_predicted_from_its_batched_costs_and_never_below_alone() -> None:
    """Catches --concurrency N priced at B = 1's costs, E[L] taken as 1 + mean accepted at a
    gamma whose alpha was not inverted, or auto below 1x where no gamma pays."""
    costs = _costs(100.0, {1: 110.0, 2: 120.0}, {1: 5.0, 2: 10.0})
    costs["step_ms"]["8"] = 400.0  # eight rows batched: one step of 8 sequences
    pred = real_costs.one_target_batched(costs, {1: 0.5, 2: 1.0}, 8)
    assert pred["g1"] == pytest.approx(1.5 * 400.0 / 115.0)
    assert pred["auto"] == pytest.approx(max(pred["g1"], pred["g2"]))
    compute_bound = _costs(100.0, {1: 200.0, 2: 300.0}, {1: 5.0, 2: 10.0})
    assert real_costs.one_target_batched(compute_bound, {1: 0.5, 2: 1.0}, 8)["auto"] == 1.0


def test_a_cost_is_read_between_the_measured_row_counts() -> None:
    """Catches a stream's forward of 6 rows priced at 8 rows' or 4 rows' cost (not between),
    or a count outside the measured ones extrapolated (a line through 3 and 4 rows' costs
    read 0 or less at one row on this CPU)."""
    table = {"1": 50.0, "4": 80.0, "8": 120.0}
    assert real_costs.at_rows(table, 6) == pytest.approx(100.0)
    assert real_costs.at_rows(table, 2) == pytest.approx(60.0)
    assert real_costs.at_rows(table, 4) == 80.0
    assert real_costs.at_rows(table, 16) == 120.0 and real_costs.at_rows({"3": 7.0}, 1) == 7.0


def test_a_stream_of_full_batches_is_predicted_as_full_batches() -> None:
    """Catches the stream model drifting from the full-batch one where the stream is full
    batches throughout (16 requests of 6 tokens, 8 at a time): a forward priced at the wrong
    rows, or E[L] not committed to every row."""
    costs = _costs(100.0, {1: 110.0}, {1: 5.0})
    costs["step_ms"] = {"1": 50.0, "3": 70.0, "4": 80.0, "8": 400.0}  # only 8 rows are run
    alone_s = 2 * 6 * 0.400  # two waves of 8, 6 steps each
    stream = real_costs.one_target_stream(costs, {1: 0.5}, 8, [6] * 16, alone_s)
    full = real_costs.one_target_batched(costs, {1: 0.5}, 8)
    assert stream["g1"] == pytest.approx(full["g1"]) == pytest.approx(1.5 * 400.0 / 115.0)


def test_a_streams_tail_and_prefills_are_priced_as_the_stream_ran_them() -> None:
    """Catches a stream's last forwards (fewer rows open, where this CPU's verification costs
    up to 2x a step against 1.09x at 8) priced at a full batch's ratio, and the target
    alone's time beyond its decoding (its prefills) left out of either side (both pay it), and
    an ended request's slot left empty until its whole wave ends."""
    costs = _costs(100.0, {1: 200.0}, {1: 0.0})  # at 1 row a round costs 2 steps ...
    costs["verify_ms"]["8"]["1"] = 100.0  # ... at 8 rows one
    # 8 rows throughout while the 7 short requests' slots are taken by 7 of 8 tokens, then the
    # long one alone for its last 4 tokens
    lengths = [4] * 7 + [16] + [8] * 7
    alone_ms = (4 + 8) * 100.0 + 4 * 100.0
    hub_ms = (2 + 4) * 100.0 + 2 * 200.0  # E[L] 2 (a mean of 1 accepted at gamma 1)
    pred = real_costs.one_target_stream(costs, {1: 1.0}, 8, lengths, alone_ms / 1e3)
    assert pred["g1"] == pytest.approx(alone_ms / hub_ms, rel=1e-6)
    prefilled = real_costs.one_target_stream(costs, {1: 1.0}, 8, lengths, alone_ms / 1e3 + 0.6)
    assert prefilled["g1"] == pytest.approx((alone_ms + 600.0) / (hub_ms + 600.0), rel=1e-6)


def test_the_batched_model_prices_the_batched_modes_own_acceptance() -> None:
    """Catches the model at --concurrency N fed the centralized loop's acceptance, measured on
    fewer chats (another workload) than the batched modes run, where a fixed-gamma batched mode
    measured its own; and a gamma with no batched mode left without any."""
    central = {f"central-e3-g{g}": {"mean_accepted": 0.1 * g} for g in real.CENTRAL_GAMMAS}
    batched = {"hub-e3-g2-c8": {"mean_accepted": 0.9}, "hub-e3-g1-c4": {"mean_accepted": 0.7}}
    runs = central | batched
    assert real.batched_acceptance(runs, 8) == {1: 0.1, 2: 0.9, 4: 0.4}
    assert real.batched_acceptance(runs, 4) == {1: 0.7, 2: 0.2, 4: 0.4}


def test_many_targets_on_one_hub_slow_down_only_once_the_hub_is_full() -> None:
    """Catches the N-target prediction ignoring the hub's load (each target predicted as if
    alone on the hub) or ignoring its batching (S(N) taken as N * S(1))."""
    light = _costs(100.0, {1: 50.0}, {1: 5.0})
    assert real_costs.many_targets(light, {1: 0.5}, 3)["g1"] == pytest.approx(1.5 * 100 / 55)
    heavy = _costs(100.0, {1: 50.0}, {1: 5.0})
    heavy["draft_ms"] = {"1": {"1": 100.0}, "3": {"1": 300.0}, "4": {"1": 400.0}, "8": {"1": 800.0}}
    slow = real_costs.many_targets(heavy, {1: 0.5}, 3)["g1"]
    assert slow == pytest.approx(1.5 * 100 / (300.0 + 50.0))  # one batch of 3: S(3) + V
    batched = _costs(100.0, {1: 50.0}, {1: 5.0})
    batched["draft_ms"]["3"]["1"] = 6.0  # three jobs in one forward cost little more than one
    assert real_costs.many_targets(batched, {1: 0.5}, 3)["g1"] > 1.5 * 100 / (3 * 5.0 + 50.0)


def test_each_plotted_mode_gets_the_prediction_of_its_own_load() -> None:
    """Catches a batched mode plotted beside the one-target prediction (or none)."""
    result = {
        "predicted": {"g1": 0.7, "g2": 0.6, "auto": 1.0},
        "predicted_batched": {
            "c8": {"auto": 1.2},
            "3t": {"auto": 1.1},
            "e3-c8": {"g1": 1.3, "g2": 1.35, "auto": 1.25},
        },
    }
    assert predicted_for(result, "hub-g2") == 0.6
    assert predicted_for(result, "central-g1") == 0.7
    assert predicted_for(result, "hub-auto") == 1.0
    assert predicted_for(result, "hub-auto-c8") == 1.2
    assert predicted_for(result, "hub-3t") == 1.1
    assert predicted_for(result, "hub-e3-auto-c8") == 1.25  # the head's costs, not the LLM's
    assert predicted_for(result, "hub-e3-g1-c8") == 1.3
    assert predicted_for(result, "hub-e3-g2-c8") == 1.35  # each fixed gamma its own
    assert math.isnan(predicted_for(result, "hub-e3-auto-c4"))
    assert math.isnan(predicted_for(result, "prompt-lookup"))
    result["predicted_stream"] = {"e3-c8": {"g2": 1.2}}  # over the stream the mode ran
    assert predicted_for(result, "hub-e3-g2-c8", stream=True) == 1.2
    assert math.isnan(predicted_for(result, "hub-g2", stream=True))  # one target: no stream
    assert math.isnan(predicted_for(result, "hub-3t", stream=True))


def test_the_stream_model_runs_on_each_batched_baselines_own_stream() -> None:
    """Catches the stream model fed another concurrency's requests or time alone, or the
    centralized loop's acceptance where the batched mode measured its own."""
    costs = _costs(
        100.0, {g: 110.0 for g in real.CENTRAL_GAMMAS}, dict.fromkeys(real.CENTRAL_GAMMAS, 5.0)
    )
    costs["draft_ms_e3"] = costs["draft_ms"]
    central = {
        f"central{d}-g{g}": {"mean_accepted": 0.5} for d in ("", "-e3") for g in real.CENTRAL_GAMMAS
    }
    runs = central | {
        "standalone-c8": {"tokens": 96, "tokens_per_s": 10.0, "lengths": [6] * 16},
        "standalone-c4": {"tokens": 12, "tokens_per_s": 20.0, "lengths": [3] * 4},
        "hub-e3-g1-c8": {"mean_accepted": 1.0},
    }
    out = real.stream_predictions(runs, costs)
    for key, lengths, alone_s, accepted in [
        ("c8", [6] * 16, 9.6, 0.5),
        ("e3-c8", [6] * 16, 9.6, 1.0),
        ("e3-c4", [3] * 4, 0.6, 0.5),
    ]:
        n = int(key[-1])
        own = real_costs.one_target_stream(costs, {1: accepted}, n, lengths, alone_s)["g1"]
        assert out[key]["g1"] == pytest.approx(own)


def test_a_subset_of_modes_keeps_its_baselines_and_the_models_inputs() -> None:
    """Catches ``--modes`` running a batched mode without the standalone run at its concurrency
    (its ratio would have no baseline) or without the centralized runs the predictions need."""
    names = [
        "standalone",
        "hub-auto",
        "hub-g1",
        "standalone-inproc",
        "central-g1",
        "central-g2",
        "standalone-c4",
        "hub-auto-c4",
        "standalone-c8",
        "hub-auto-c8",
        "standalone-3t",
        "hub-3t",
    ]
    modes = {n: (lambda: {}) for n in names}
    assert list(real.selected(modes, [])) == names
    assert list(real.selected(modes, ["hub-auto-c4"])) == [
        "standalone",
        "standalone-inproc",
        "central-g1",
        "central-g2",
        "standalone-c4",
        "hub-auto-c4",
    ]


def test_a_subset_runs_the_centralized_trees_only_for_a_tree_mode() -> None:
    """Catches ``--modes hub-e3-auto-c8`` paying for every token tree in process (minutes of
    runs no prediction of it reads), or a tree mode run without its trees' costs."""
    names = [
        "standalone",
        "standalone-inproc",
        "central-e3-g1",
        "central-e3-t2x4n8",
        "standalone-c8",
        "hub-e3-auto-c8",
        "hub-e3-g1-c8",
        "hub-e3-trees",
    ]
    modes = {n: (lambda: {}) for n in names}
    assert list(real.selected(modes, ["hub-e3-auto-c8", "hub-e3-g1-c"])) == [
        "standalone",
        "standalone-inproc",
        "central-e3-g1",
        "standalone-c8",
        "hub-e3-auto-c8",
        "hub-e3-g1-c8",
    ]
    assert "central-e3-t2x4n8" in real.selected(modes, ["hub-e3-trees"])


def test_a_streams_rate_is_read_from_the_targets_own_summary_line(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """Catches the benchmark parsing a summary line ``edge.target`` no longer writes (every
    --concurrency mode would fail), or rating a stream by its sequences' summed decode times
    (which leave out the slots a stream's tail leaves empty)."""
    results = [Result(0, "p", "t", [1] * 100, {"rounds": 50, "accepted": 50})]
    with caplog.at_level(logging.INFO, logger="edge.target"):
        target._log_summary(results, 12.5, BatchStats())
    assert real.run_wall_s(caplog.text) == 12.5
    with pytest.raises(RuntimeError, match="no summary line"):
        real.run_wall_s("edge.target ERROR hub gone")
    line = {
        "token_ids": [1] * 100,
        "stats": {"tokens_per_s": 20.0, "rounds": 50, "accepted": 50, "alone_steps": 0},
    }
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(line) + "\n")
    assert real.target_result(out)["tokens_per_s"] == pytest.approx(20.0)  # its decode time
    assert real.target_result(out, wall_s=10.0)["tokens_per_s"] == pytest.approx(10.0)


def test_asking_for_more_chats_than_are_held_out_is_refused() -> None:
    """Catches a stream silently cut to the held-out chats there are (a --concurrency 8 stream
    of "24" chats ran 16, and its figures said 24)."""
    assert len(real.chat_rows(real.HELD_OUT)) == real.HELD_OUT
    with pytest.raises(ValueError, match="held out"):
        real.chat_rows(real.HELD_OUT + 1)
    with pytest.raises(ValueError, match="held out"):
        real.chat_rows(2, first=real.HELD_OUT - 1)


class _OrderedProposer:
    """A proposer that records, in one list with the sweeps, when it drafts."""

    kind, feature_width = "ordered", 0

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def new_state(self, prompt: list[int], params: object, gamma: int) -> SimpleNamespace:
        return SimpleNamespace(tokens=list(prompt))

    def propose(self, jobs: list) -> list:
        self.events.append(f"propose {len(jobs)}")
        return [Proposal(job.tag, job.seq, np.array([1], dtype=np.int32)) for job in jobs]


def test_each_timed_draft_follows_a_sweep_of_the_machines_other_work() -> None:
    """Catches S(B, g) timed hot (each call finding the head's weights left in the caches by
    the call before): in a run on one machine the target's forward sweeps the shared caches
    between two hub batches, and the hot figure (7.8 ms at B = 8) priced the hub's batches,
    which took 10-11 ms, as 25% cheaper."""
    events: list[str] = []
    real_costs.time_drafts(
        _OrderedProposer(events), 64, (1, 3), (1,), 2, between=lambda: events.append("sweep")
    )
    timed = events[2:]  # (after each size's untimed prefill)
    pairs = zip(timed[::2], timed[1::2], strict=True)
    assert timed and all(a == "sweep" and b.startswith("propose") for a, b in pairs)
    assert len(timed) == 2 * 2 * 3  # two sizes, a warm-up pass and two repeats, each swept


def test_chats_of_the_one_target_modes_are_refused_at_the_flag_beyond_the_held_out_set() -> None:
    """Catches a --chats past the held-out chats failing only after the models load (in
    chat_rows, minutes into the run), and a --chats 0 that runs no one-target chat."""
    assert real._chats(str(real.HELD_OUT)) == real.HELD_OUT
    for bad in ("0", str(real.HELD_OUT + 1)):
        with pytest.raises(argparse.ArgumentTypeError, match="--chats takes 1"):
            real._chats(bad)


def test_a_runs_lengths_reach_the_stream_model(tmp_path: Path) -> None:
    """Catches the requests' lengths dropped on the way from a target's --out file to the
    summary (the repeats' medians keep numbers only): the stream model would silently be
    left out of the result."""
    stats = {"tokens_per_s": 10.0, "rounds": 2, "accepted": 1, "alone_steps": 0}
    out = tmp_path / "t-out.jsonl"
    rows = [{"token_ids": [1] * n, "stats": stats} for n in (3, 5)]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = real.target_result(out, wall_s=0.8)
    assert run["lengths"] == [3, 5] and run["tokens_per_s"] == pytest.approx(10.0)
    kept = real.medians({"standalone-c8": [run, run]})["standalone-c8"]
    assert kept["lengths"] == [3, 5] and kept["ids"] == run["ids"]
