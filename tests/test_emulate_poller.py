"""The poller driver of the emulated targets (scripts.emulate.poller) and the per-sequence rounds
both drivers share (scripts.emulate.rounds)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import zmq
from conftest import RunningHub

from edge.handshake import TargetInfo
from scripts.emulate.config import EmulationConfig, Phases, schedule
from scripts.emulate.emulated import emulate, parse_args, target_info
from scripts.emulate.poller import PolledEmulation, PolledTarget, emulate_polled
from scripts.emulate.report import TargetRecord
from scripts.emulate.rounds import SequenceRounds, proposal_bytes
from starsd.protocol import Error, ErrorCode, Ping, Proposal


def _cfg(endpoint: str, model: Path) -> EmulationConfig:
    return EmulationConfig(
        hub=endpoint,
        targets=3,
        alpha=0.6,
        verify_ms=2.0,
        duration=0.6,
        warmup=0.2,
        calibration=0.3,
        model=str(model),
    )


async def test_the_poller_fills_the_asyncio_drivers_report(
    running_hub: RunningHub, llama_pair: tuple[Path, Path]
) -> None:
    """Catches a poller whose report misses a field the benchmarks read, counts no rounds or
    no STATS (the hub's figures), counts a proposal's bytes other than as received, or does not
    measure its own serial cost. (The hub serves on this loop: the poller runs in a thread.)"""
    cfg = _cfg(running_hub.endpoint, llama_pair[0])
    polled = await asyncio.to_thread(emulate_polled, replace(cfg, driver="poll"), target_info(cfg))
    asynced = await emulate(replace(cfg, driver="asyncio"))
    assert set(polled) == set(asynced)
    assert polled["rounds"] > 0 and polled["system_tokens_per_s"] > 0
    assert 0.0 < polled["hub_busy_fraction"] <= 1.0 and polled["hub_batches"] > 0
    assert polled["calibration"]["jobs"] > 0
    assert polled["sequence_errors"] == 0
    assert polled["bytes_per_round"] == pytest.approx(asynced["bytes_per_round"], rel=0.02)
    assert 0.0 < polled["load_generator_ms_per_round"] < 5.0
    assert asynced["load_generator_ms_per_round"] is None


def test_the_poller_drives_one_hub_only() -> None:
    """Catches two hubs silently driven as one (every session on the first) by the poller."""
    two = EmulationConfig(hub="tcp://127.0.0.1:5001,tcp://127.0.0.1:5002")
    assert not two.polled and not replace(two, driver="asyncio").polled
    assert EmulationConfig(hub="tcp://127.0.0.1:5001").polled
    with pytest.raises(ValueError, match="one hub"):
        PolledEmulation(replace(two, driver="poll"), TargetInfo("e", 10, "fp"))
    with pytest.raises(SystemExit):
        parse_args(["--hub", two.hub, "--driver", "poll", "--vocab-size", "9", "--tokenizer", "x"])


def _in_window(cfg: EmulationConfig) -> Phases:
    """Phases whose window (``cfg.duration`` long) began half a second ago."""
    phases = Phases()
    phases.bounds = [b - 1.0 for b in schedule(time.perf_counter(), cfg)]
    assert phases.kind(time.perf_counter()) == "window"
    return phases


def _rounds(cfg: EmulationConfig, phases: Phases) -> tuple[SequenceRounds, TargetRecord]:
    record = TargetRecord()
    return SequenceRounds(cfg, random.Random(0), 50, phases, record, "hub"), record


def _proposal(seq: int, gamma: int, alone: int = 0) -> Proposal:
    tokens = np.arange(gamma, dtype=np.int32)
    return Proposal(b"t" * 16, seq, tokens, alone=alone)


def test_a_sequence_counts_its_rounds_and_ends_where_the_hub_ends_it() -> None:
    """Catches a sequence that goes on after an ERROR (or counts it nowhere), answers a message
    that is no proposal, waits other than the verify time, or loses a window round."""
    cfg = EmulationConfig(hub="", verify_ms=3.0, duration=100.0, calibration=1.0, slices=1)
    phases = _in_window(cfg)
    rounds, record = _rounds(cfg, phases)
    ans = rounds.take(_proposal(0, 4), wire_bytes=123)
    assert ans is not None and ans.wait_s == pytest.approx(0.003) and 0 <= ans.accepted <= 4
    assert rounds.settle(ans) == 1 and rounds.generated == ans.accepted + 1
    assert record.had_proposal and phases.first_proposals == 1
    assert record.rounds == 1 and record.tokens == ans.accepted + 1
    assert rounds.take(Error(ErrorCode.CONTEXT_FULL, "full")) is None and record.errors == 1
    with pytest.raises(RuntimeError, match="hub"):
        rounds.take(Ping(1))
    assert rounds.take(_proposal(1, 0, alone=0)) is None  # nothing to verify nor to decode


def test_an_emulated_target_reports_its_forwards_as_a_real_one_does() -> None:
    """Catches the replay pricing R's slope other than a real target's hub does: a real target
    reports its forwards' mean time (Draft.forward_us), the verification's or one step's of a
    span alone, and the emulated ones must too (else the hub falls back to the round trips)."""
    cfg = EmulationConfig(
        hub="", verify_ms=3.0, alone_step_ms=2.0, duration=100.0, calibration=1.0, slices=1
    )
    rounds, _ = _rounds(cfg, _in_window(cfg))
    verify = rounds.take(_proposal(0, 4))
    assert verify is not None and verify.forward_s == pytest.approx(0.003)
    rounds.settle(verify)
    span = rounds.take(_proposal(1, 0, alone=5))
    assert span is not None and len(span.appended) == 5
    assert span.forward_s == pytest.approx(0.002)


def test_a_rounds_bytes_are_the_proposals_as_received_when_known() -> None:
    """Catches the received size ignored (a proposal encoded again for every round) or a
    round's bytes counted without the DRAFT back."""
    cfg = EmulationConfig(hub="", duration=100.0, calibration=1.0, slices=1)
    phases = _in_window(cfg)
    rounds, record = _rounds(cfg, phases)
    msg = _proposal(0, 4)
    ans = rounds.take(msg, wire_bytes=1000)
    assert ans is not None
    rounds.settle(ans)
    assert record.rounds == 1 and record.bytes == 1000 + 60 + 4
    rounds2, record2 = _rounds(cfg, phases)
    ans2 = rounds2.take(msg)
    assert ans2 is not None
    rounds2.settle(ans2)
    assert record2.bytes == proposal_bytes(msg) + 60 + 4


def test_a_closed_sessions_late_proposal_is_dropped() -> None:
    """Catches a proposal of a session the target has closed (the hub answered its last DRAFT
    before reading the CLOSE) taken as the new sequence's: it would be verified and answered
    under the new tag with the old seq."""
    cfg = EmulationConfig(hub="tcp://127.0.0.1:5001", duration=100.0, calibration=1.0, slices=1)
    emulation = PolledEmulation(cfg, TargetInfo("e", 50, "fp"))
    try:
        emulation.phases = _in_window(cfg)
        rounds, record = _rounds(cfg, emulation.phases)
        sock = emulation.ctx.socket(zmq.DEALER)  # (never connected: nothing is sent)
        target = PolledTarget(0, sock, random.Random(0), record)
        target.tag, target.rounds = b"n" * 16, rounds
        emulation._dispatch(target, _proposal(7, 4), 100)  # tag "t" * 16: the closed session's
        assert emulation.stale == 1 and not emulation.due and not record.had_proposal
        late_error = Error(ErrorCode.CONTEXT_FULL, "full", tag=b"t" * 16)
        emulation._dispatch(target, late_error, 50)
        assert emulation.stale == 2 and record.errors == 0
    finally:
        emulation.ctx.destroy(linger=0)
