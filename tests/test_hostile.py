"""Hostile peers, hub level: each attack of the hostile-peer review, and the fixed behaviour.

Loopback only, bounded in count and time. The in-process tests check the exact effect of an
attack on the hub's state; the ``slow`` ones run a real hub process, attackers in their own
processes (scripts/hostile/hostile.py, at nice 19) and a legitimate target beside them whose greedy
output must equal the target alone and whose throughput is compared with its own quiet runs,
alternated in the same test. Wire-level attacks (routing ids, unfinished messages): see
tests/test_hostile_wire.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
from conftest import PROMPT, RawTarget
from procs import HubProcess
from test_hub import _greedy_reference, _speculate

from scripts.hostile import hostile
from starsd import hub as hub_module
from starsd import models, protocol, transport
from starsd.protocol import Draft, Error, ErrorCode, Open, Ping, Pong, SamplingParams


@contextlib.asynccontextmanager
async def serving(draft_dir: Path, **config: object) -> AsyncIterator[hub_module.Hub]:
    """An in-process hub on a random loopback port with ``config`` overrides."""
    hub = hub_module.build_hub(
        hub_module.HubConfig(
            model=str(draft_dir), bind="tcp://127.0.0.1:*", stats_interval=3600, **config
        )
    )  # type: ignore[arg-type]
    ctx = transport.new_context()
    task = asyncio.create_task(hub.serve(ctx))
    while not hub.endpoint:
        await asyncio.sleep(0.01)
    try:
        yield hub
    finally:
        hub.stop()
        await asyncio.wait_for(task, 20)
        ctx.term()


async def _welcomed(hub: hub_module.Hub, target: models.LoadedModel) -> RawTarget:
    raw = RawTarget(hub.endpoint)
    await raw.hello(target)
    return raw


# ---------------------------------------------------------------- 3: CLOSE and queued work


async def test_close_removes_the_queued_job_so_churn_drafts_almost_nothing(
    llama_pair: tuple[Path, Path], llama_target: models.LoadedModel
) -> None:
    """Attack 3. Catches: a CLOSEd session's job left in Q_in and drafted anyway (8,040
    OPEN+CLOSE pairs once queued ~5 minutes of drafting and +364 MB)."""
    async with serving(llama_pair[1], max_batch=1) as hub:  # _Slow's delay is per call
        raw = await _welcomed(hub, llama_target)
        hub.engine.proposer = slow = _Slow(hub.proposer, 0.02)  # drafting is the bottleneck
        opened = 0
        for _ in range(2):  # 200 messages: within the peer's message budget (5 s x 50/s)
            for ref in range(50):
                await raw.send(Open(ref, PROMPT, SamplingParams(), 4))
            opened += await _close_each_opened(raw, 50)
        await asyncio.sleep(0.3)
        with hub.lock:
            assert not hub.sessions and not hub.q_in._queues  # nothing left behind
        assert opened == 100 and slow.drafted < 25, slow.drafted  # not 100
        raw.close()


async def _close_each_opened(raw: RawTarget, expect: int) -> int:
    closed = 0
    while closed < expect:
        reply = await raw.recv()
        if isinstance(reply, protocol.Opened):
            await raw.send(protocol.Close(reply.tag))
            closed += 1
    return closed


class _Slow:
    """A proposer that takes ``delay_s`` per job and counts the jobs it drafts."""

    def __init__(self, inner: object, delay_s: float) -> None:
        self.inner, self.delay_s, self.drafted = inner, delay_s, 0

    def propose(self, jobs: list) -> list:
        time.sleep(self.delay_s)
        self.drafted += len(jobs)
        return self.inner.propose(jobs)  # type: ignore[attr-defined]


async def test_a_drain_with_a_backlog_keeps_its_timeout(
    llama_pair: tuple[Path, Path], llama_target: models.LoadedModel
) -> None:
    """Attack 3, SIGTERM. Catches: a drain that drafts the whole backlog before exiting
    (79.6 s against --drain-timeout-s 5)."""
    hub = hub_module.build_hub(
        hub_module.HubConfig(
            model=str(llama_pair[1]),
            bind="tcp://127.0.0.1:*",
            drain_timeout_s=0.5,
            max_sessions_per_target=200,
            max_batch=1,
        )
    )
    # one job per call, 50 ms each: 100 jobs are 5 s of drafting (a batch is not interrupted)
    hub.engine.proposer = slow = _Slow(hub.proposer, 0.05)
    ctx = transport.new_context()
    task = asyncio.create_task(hub.serve(ctx))
    while not hub.endpoint:
        await asyncio.sleep(0.01)
    raw = await _welcomed(hub, llama_target)
    for ref in range(100):
        await raw.send(Open(ref, PROMPT, SamplingParams(), 4))
    while len(hub.sessions) < 100:
        await asyncio.sleep(0.01)
    started = time.monotonic()
    hub.stop()
    await asyncio.wait_for(task, 10)
    assert time.monotonic() - started < 2.0 and slow.drafted < 50
    raw.close()
    ctx.term()


# ---------------------------------------------------------------- 4: CONTEXT_FULL re-sent


async def test_a_draft_refused_for_context_never_grows_the_session(
    llama_pair: tuple[Path, Path], llama_target: models.LoadedModel
) -> None:
    """Attack 4. Catches: each re-sent DRAFT after CONTEXT_FULL appending its tokens before
    the check (32 sessions grew the hub by 370 MB in 30 s)."""
    async with serving(llama_pair[1]) as hub:
        raw = await _welcomed(hub, llama_target)
        limit = hub.proposer.max_positions
        assert limit is not None
        tag, _ = await raw.open(np.arange(limit - 8, dtype=np.int32))
        state = hub.sessions[tag].state
        appended = np.zeros(16, dtype=np.int32)
        for _ in range(50):  # within the peer's message budget: each one answered
            reply = await raw.ask(Draft(tag, 1, 0, appended))
            assert isinstance(reply, Error) and reply.code == ErrorCode.CONTEXT_FULL, reply
        frames = protocol.encode(Draft(tag, 1, 0, appended))
        for _ in range(2000):  # and as fast as it goes (most are cut by the budget)
            await raw.send_frames(frames)
        await _until_pong(raw)  # all of them handled or dropped by now
        assert len(state.tokens) == limit - 8 and hub.sessions[tag].length == limit - 8
        raw.close()


async def _until_pong(raw: RawTarget) -> None:
    """PING until a PONG comes back (replies to earlier messages are read and skipped)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        await raw.send(Ping(77))
        with contextlib.suppress(TimeoutError):
            while not isinstance(reply := await raw.recv(timeout=1.0), Pong):
                del reply
            return
    raise TimeoutError("no PONG within 30 s")


# ---------------------------------------------------------------- 5: session hogs


async def test_connections_of_one_hog_leave_sessions_for_a_newcomer(
    llama_pair: tuple[Path, Path], llama_target: models.LoadedModel
) -> None:
    """Attack 5. Catches: every hub session taken by a few connections, so a legitimate target
    arriving later decodes alone (960 fallback steps)."""
    # Scaled from the attack: 4 connections x the per-target quota = every session of the hub.
    async with serving(llama_pair[1], max_sessions=32, max_sessions_per_target=8) as hub:
        hogs = [await _welcomed(hub, llama_target) for _ in range(4)]
        for hog in hogs:
            for ref in range(8):
                reply = await hog.ask(Open(ref, PROMPT, SamplingParams(), 4))
                if isinstance(reply, Error):
                    assert reply.code == ErrorCode.RESOURCE_EXHAUSTED
        assert len(hub.sessions) < 32
        prompts = [[5, 17, 33, 8], list(range(40, 50))]
        seqs = await _speculate(hub.endpoint, llama_target, prompts, 24, SamplingParams())
        for prompt, seq in zip(prompts, seqs, strict=True):
            assert seq.generated == _greedy_reference(llama_target, prompt, 24)
            assert seq.stats.standalone_steps == 0 and seq.stats.rounds > 0
        for hog in hogs:
            hog.close()


# ---------------------------------------------------------------- 6: floods


async def test_a_flooder_is_cut_to_its_budget_and_its_replies_are_not_logged(
    llama_pair: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Attack 6. Catches: a PING flood answered in full (every reply encoded and, once the
    flooder stops reading, one log line per dropped reply: 166k lines)."""
    caplog.set_level(logging.INFO, logger="starsd")
    async with serving(llama_pair[1]) as hub:
        flood = RawTarget(hub.endpoint)
        frames = protocol.encode(Ping(3))
        for _ in range(5000):
            await flood.sock.send_multipart(frames)
        deadline = time.monotonic() + 20
        while hub.stats.messages < 5000 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with hub.lock:
            over, handled = hub.stats.over_budget, hub.stats.messages - hub.stats.over_budget
        assert over > 4000 and handled < 1000, (over, handled)  # burst: 5 s x 20/s
        assert len(caplog.records) < 20
        pong = await RawTarget(hub.endpoint).ask(Ping(9))  # another peer is served at once
        assert isinstance(pong, Pong) and pong.nonce == 9
        flood.close()


# ---------------------------------------------------------------- 7, 8: decoder and logs


async def test_mixed_key_types_are_malformed_over_the_socket(llama_pair: tuple[Path, Path]) -> None:
    """Attack 7. Catches: sorted() on str and bytes keys raising inside decode (INTERNAL and
    a traceback per message)."""
    async with serving(llama_pair[1]) as hub:
        raw = RawTarget(hub.endpoint)
        body = msgpack.packb({"nonce": 1, "zz": 1, b"yy": 2}, use_bin_type=True)
        await raw.send_frames([bytes((protocol.PROTOCOL_VERSION, Ping.TYPE)) + body])
        reply = await raw.recv()
        assert isinstance(reply, Error) and reply.code == ErrorCode.MALFORMED, reply
        raw.close()


async def test_peer_strings_cannot_forge_log_lines(
    llama_pair: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Attack 8. Catches: an ERROR's text or a HELLO's model name logged verbatim, newlines
    and ANSI escapes included (a forged '... starsd.hub INFO FORGED' line)."""
    caplog.set_level(logging.INFO, logger="starsd")
    forged = "x\n2026-11-30 12:00:00,000 starsd.hub INFO FORGED \x1b[2J" + "A" * 3000
    async with serving(llama_pair[1]) as hub:
        raw = RawTarget(hub.endpoint)
        await raw.send(Error(ErrorCode.INTERNAL, forged))
        await raw.send(protocol.Hello(forged, 1, "x"))
        assert isinstance(await raw.recv(), Error)  # the HELLO is refused (vocabulary)
        raw.close()
    lines = [r.getMessage() for r in caplog.records]
    assert any("FORGED" in line for line in lines), lines  # it was logged...
    assert all("\n" not in line and "\x1b" not in line and len(line) < 1000 for line in lines)


# ---------------------------------------------------------------- throughput beside attacks


@pytest.fixture(scope="module")
def committed_target() -> models.LoadedModel:
    """The committed target: a round costs real model work here, as in a deployment (with the
    tiny test models a round is all messaging, and any CPU an attacker takes shows 1:1)."""
    return models.load_causal_lm(models.TOY_TARGET_DIR)


@pytest.fixture
def attacked_hub(tmp_path: Path) -> Iterator[HubProcess]:
    hub = HubProcess(
        models.TOY_DRAFT_DIR,
        tmp_path / "hub.log",
        "--max-sessions",
        "64",
        "--max-sessions-per-target",
        "16",
    )
    yield hub
    assert hub.stop() == 0


@pytest.mark.slow
@pytest.mark.load
@pytest.mark.parametrize("attack", ["churn", "context", "hog", "flood"])
def test_a_legitimate_target_keeps_its_output_and_most_of_its_speed(
    attack: str, attacked_hub: HubProcess, committed_target: models.LoadedModel
) -> None:
    """Attacks 3-6 from their own processes beside a legitimate target. Catches: any attack
    that changes the target's output, or costs it more than 30% of its quiet throughput
    (before the fixes: churn 137 -> 33, hog 150 -> 55, flood 108 -> 17-22 tok/s). The hog is
    the review's: 4 connections whose quotas add up to the whole hub (in plain text each
    connection is a target; more of them are a Sybil attack, which only keys stop).

    Marked ``load``: `make test-load` runs it, `make test` does not. On this 2-core VM the
    ratio of one attacked run to the next moves 0.4-1.0 with nothing changed (the attackers,
    the hub and the target share two cores), so the 0.7 goal is a measurement to read here,
    not a gate CI can hold; see SECURITY.md for the figures."""
    target = committed_target
    prompts = [
        models.encode_text(target, p)
        for p in ("ROMEO:\nBut soft", "HAMLET:\nTo be", "JULIET:\nO Romeo")
    ]
    reference = [_greedy_reference(target, p, 32) for p in prompts]
    a = hostile.Attack(
        attacked_hub.endpoint,
        target.vocab_size,
        target.tokenizer_fingerprint,
        seconds=2.5,
        connections=4 if attack == "hog" else 8,
        max_positions=target.max_positions or 256,
    )
    legit = functools.partial(
        hostile.legit_tokens_per_s, attacked_hub.endpoint, target, prompts, 32
    )
    outcome = asyncio.run(
        hostile.measure(attack, a, attacked_hub.proc.pid, legit, reference, rounds=3)
    )
    assert outcome.outputs_identical
    assert outcome.ratio >= 0.7, vars(outcome)
    assert outcome.rss_growth_mb < 100, vars(outcome)
    assert attacked_hub.proc.poll() is None
