"""Several hubs per target (edge.hubs): the hub list, load reports, placement, failover.

Pure tests first (parsing, the least-sessions rule, pick), then in-process hubs on random
loopback ports: the load a hub reports, a target that starts on the one live hub of two, and
sequences that move to the surviving hub when theirs stops, token for token equal to the target
alone. The end-to-end case with real processes is tests/test_failover.py.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import RunningHub

from edge.backends.torch import TorchBackend
from edge.batcher import Batcher
from edge.client import HubClient
from edge.handshake import HubLoad, LoadView, TargetInfo
from edge.hubs import HubPool, parse_hub_endpoints
from edge.speculate import Fallback, generate_speculative
from edge.target import parse_args
from edge.verifier import TargetSequence
from starsd import hub as hub_module
from starsd import models, protocol, transport
from starsd.protocol import Pong, SamplingParams, Welcome
from starsd.stats import BusyWindow

# ------------------------------------------------------------------------------ the hub list


def test_hub_list_keeps_order_and_strips_spaces() -> None:
    assert parse_hub_endpoints("tcp://a:5555, tcp://10.0.0.2:6000,ipc:///tmp/h") == (
        "tcp://a:5555",
        "tcp://10.0.0.2:6000",
        "ipc:///tmp/h",
    )
    assert parse_hub_endpoints("tcp://[::1]:5555") == ("tcp://[::1]:5555",)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("tcp://a:5555,tcp://a:5555", "listed twice"),
        ("tcp://a:5555,,tcp://b:5555", "empty entry"),
        ("tcp://a:5555,", "empty entry"),
        ("http://a:5555", "not a ZeroMQ endpoint"),
        ("a:5555", "not a ZeroMQ endpoint"),
        ("tcp://a", "not a ZeroMQ endpoint"),
        ("tcp://a:99999", "out of range"),
        ("tcp://a:5555 tcp://b:5555", "not a ZeroMQ endpoint"),
    ],
)
def test_bad_hub_lists_are_refused_naming_the_problem(text: str, problem: str) -> None:
    # Catches a list that silently connects twice to one hub, or to nothing.
    with pytest.raises(ValueError, match=problem):
        parse_hub_endpoints(text)


def test_the_command_line_refuses_a_bad_hub_list_at_start(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--hub", "tcp://a:1,tcp://a:1", "--prompt", "x"])
    assert "listed twice" in capsys.readouterr().err
    config = parse_args(["--hub", "tcp://a:1,tcp://b:2", "--prompt", "x"])
    assert config.hubs == ("tcp://a:1", "tcp://b:2")


def test_one_public_key_for_all_hubs_or_one_per_hub(tmp_path: Path) -> None:
    two = ["--hub", "tcp://a:1,tcp://b:2", "--prompt", "x", "--curve-secret", "s.key"]
    curves = parse_args([*two, "--hub-public-key", "h.key"]).curves
    assert [c.server_public_key_file for c in curves if c] == [Path("h.key")] * 2
    curves = parse_args([*two, "--hub-public-key", "a.key,b.key"]).curves
    assert [c.server_public_key_file for c in curves if c] == [Path("a.key"), Path("b.key")]
    with pytest.raises(SystemExit):
        parse_args([*two, "--hub-public-key", "a.key,b.key,c.key"])


# ------------------------------------------------------------------------- spare capacity


def test_load_reports_are_clamped() -> None:
    # A hostile or buggy hub cannot attract every session with a negative load.
    load = HubLoad.of(Pong(1, sessions=-5, queue=-1, busy=float("nan")))
    assert load == HubLoad(0, 0, 1.0)
    assert HubLoad.of(Pong(1, busy=-3.0)).busy == 0.0


def test_a_hub_holds_its_sessions_its_queue_and_ours_not_yet_reported() -> None:
    assert HubLoad(4, queue=6, busy=1.0).holds(0) > HubLoad(4, queue=1, busy=1.0).holds(0)
    assert HubLoad(0, 0, 0.0).holds(3) == HubLoad(0, 0, 0.0).holds(0) + 3


class _FakeClient:
    """What HubPool.pick reads of a HubClient."""

    def __init__(
        self,
        name: str,
        load: HubLoad,
        up: bool = True,
        features: bool = False,
        full: bool = False,
        aside: bool = False,
    ) -> None:
        self.endpoint, self.up = name, up
        self._full, self._aside = full, aside
        self.needed_taps = (-1,) if features else ()
        self.placement = LoadView()
        self.placement.welcomed(load, 0.0)

    def full(self) -> bool:
        return self._full

    def set_aside(self) -> bool:
        return self._aside


def _pool(*clients: _FakeClient) -> HubPool:
    return HubPool(list(clients))  # type: ignore[arg-type]


def _pick(pool: HubPool, taps: tuple[int, ...] = (-1,)) -> str | None:
    client = pool.pick(taps)
    return None if client is None else client.endpoint


def test_a_burst_of_opens_alternates_between_idle_hubs() -> None:
    # Without counting the sessions placed since the last report, all 8 land on one hub.
    pool = _pool(_FakeClient("a", HubLoad()), _FakeClient("b", HubLoad()))
    picks = [_pick(pool) for _ in range(8)]
    assert picks.count("a") == picks.count("b") == 4


def test_many_targets_starting_together_spread_over_equal_hubs() -> None:
    """Catches the herd: 64 targets that see the same reports and each pick the same hub
    (measured before the random order among tied hubs: all 64 sessions on one hub)."""

    def target(seed: int) -> HubPool:  # each target its own clients, the same reports
        clients = [_FakeClient("a", HubLoad(4, 0, 0.5)), _FakeClient("b", HubLoad(4, 0, 0.5))]
        return HubPool(clients, random.Random(seed))  # type: ignore[arg-type]

    picks = [_pick(target(seed)) for seed in range(64)]
    assert 20 <= picks.count("a") <= 44


def test_a_freshly_loaded_hub_is_not_priced_by_its_lagging_busy_window() -> None:
    """Catches placement by ``busy / sessions``: a hub that just took 30 sessions still reports
    the low busy of the seconds before (a window), so each session looks cheap and the hub
    roomy, and every target kept placing there (measured: the fleet swung between two hubs).
    A hub freed a moment ago (its busy still high) must not be shunned either."""
    filling, draining = HubLoad(sessions=30, busy=0.2), HubLoad(sessions=10, busy=0.99)
    assert _pick(_pool(_FakeClient("filling", filling), _FakeClient("draining", draining))) == (
        "draining"
    )
    freed = HubLoad(sessions=0, busy=0.99)
    assert _pick(_pool(_FakeClient("other", HubLoad(2, 0, 0.1)), _FakeClient("freed", freed))) == (
        "freed"
    )


def test_pick_prefers_the_hub_with_room_and_skips_down_full_aside_and_eagle_hubs() -> None:
    busy, idle = HubLoad(12, 2, 0.9), HubLoad(8, 0, 0.3)
    assert _pick(_pool(_FakeClient("busy", busy), _FakeClient("idle", idle))) == "idle"
    assert _pick(_pool(_FakeClient("busy", busy), _FakeClient("idle", idle, up=False))) == "busy"
    assert _pick(_pool(_FakeClient("busy", busy), _FakeClient("idle", idle, full=True))) == "busy"
    # a hub set aside after a strike (it sent a proposal the target refused) gets no session
    assert _pick(_pool(_FakeClient("busy", busy), _FakeClient("idle", idle, aside=True))) == "busy"
    eagle = _FakeClient("eagle", idle, features=True)
    assert _pick(_pool(_FakeClient("busy", busy), eagle), taps=()) == "busy"
    assert _pick(_pool(_FakeClient("busy", busy, up=False))) is None


def test_a_ping_is_reused_while_awaited_and_only_its_pong_is_taken() -> None:
    """Catches a second PING while one is awaited (its PONG would then look unsolicited), a
    PONG to someone else's nonce taken as a report, and a report counted as seeing sessions
    placed after its PING."""
    view = LoadView()
    view.welcomed(HubLoad(sessions=3), now=10.0)
    view.placed += 2
    assert view.since_report == 2
    assert view.ping(nonce=7, now=10.0, reuse_s=1.0) == 7
    assert view.ping(nonce=8, now=10.5, reuse_s=1.0) is None  # 7 still awaited
    assert not view.ponged(8, HubLoad(sessions=9), now=10.6)
    view.placed += 1  # after the PING: the PONG does not count it
    assert view.ponged(7, HubLoad(sessions=5), now=10.6)
    assert (view.load.sessions, view.since_report, view.reported_at) == (5, 1, 10.6)
    assert view.ping(nonce=9, now=10.7, reuse_s=1.0) == 9  # answered: a new one goes


def test_a_hub_that_does_not_answer_pings_delays_placements_once_per_ping() -> None:
    """Catches a silent (or hostile) hub that keeps the PING unanswered and so makes every new
    session wait the full ``wait_s`` for its report."""
    view = LoadView()
    view.welcomed(HubLoad(), now=0.0)
    assert not view.wants_report(now=0.01, max_age_s=0.05, wait_s=0.1)  # fresh enough
    assert view.wants_report(now=1.0, max_age_s=0.05, wait_s=0.1)
    view.ping(nonce=1, now=1.0, reuse_s=1.0)
    assert view.wants_report(now=1.05, max_age_s=0.05, wait_s=0.1)  # in flight: wait for it
    assert not view.wants_report(now=1.2, max_age_s=0.05, wait_s=0.1)  # late: use the last one
    view.ping(nonce=2, now=2.1, reuse_s=1.0)  # the heartbeat's next PING
    assert view.wants_report(now=2.15, max_age_s=0.05, wait_s=0.1)


async def test_a_pool_of_one_hub_asks_nothing_before_placing() -> None:
    """Catches a round trip added to every session open of a target with a single hub."""

    class _Counting(_FakeClient):
        asked = 0

        async def fresh_load(self, max_age_s: float, wait_s: float) -> None:
            _Counting.asked += 1

    await _pool(_Counting("a", HubLoad())).refresh()
    assert _Counting.asked == 0
    await _pool(_Counting("a", HubLoad()), _Counting("b", HubLoad())).refresh()
    assert _Counting.asked == 2


def test_busy_window_forgets_old_work() -> None:
    window = BusyWindow(window_s=2.0)
    assert window.fraction(0.0, 0.0) == 0.0
    assert window.fraction(1.0, 1.0) == pytest.approx(1.0)  # busy the whole first second
    for t in (1.5, 2.0, 2.5, 3.0, 3.5, 4.0):
        frac = window.fraction(t, 1.0)  # idle ever since
    assert frac == 0.0  # a reading that still averaged since t=0 would say 0.25


# ------------------------------------------------------------------- in-process hubs


async def _start_hub(draft: Path, **extra: object) -> tuple[hub_module.Hub, asyncio.Task, object]:
    config = hub_module.HubConfig(
        model=str(draft), bind="tcp://127.0.0.1:*", stats_interval=3600, **extra
    )  # type: ignore[arg-type]
    hub = hub_module.build_hub(config)
    ctx = transport.new_context()
    task = asyncio.create_task(hub.serve(ctx))
    while not hub.endpoint:
        await asyncio.sleep(0.01)
    return hub, task, ctx


async def _stop_hub(hub: hub_module.Hub, task: asyncio.Task, ctx: object) -> None:
    hub.stop()
    await asyncio.wait_for(task, 15)
    ctx.term()  # type: ignore[attr-defined]


def _info(target: models.LoadedModel) -> TargetInfo:
    return TargetInfo("t", target.vocab_size, target.tokenizer_fingerprint)


def _reference(target: models.LoadedModel, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=0,
        pad_token_id=0,
        eos_token_id=sorted(target.eos_token_ids) or None,
    )
    return out[0, len(prompt) :].tolist()


async def test_welcome_and_pong_carry_the_hubs_load(
    running_hub: RunningHub, llama_target: models.LoadedModel
) -> None:
    ctx = transport.new_context()
    client = HubClient(ctx, running_hub.endpoint, _info(llama_target))
    try:
        welcome = await client.connect()
        assert isinstance(welcome, Welcome) and welcome.sessions == 0
        await client.open([1, 2, 3], SamplingParams(), 4)
        await client.open([4, 5], SamplingParams(), 4)
        await client.fresh_load(max_age_s=0.0, wait_s=5.0)
        load = client.placement.load
        assert load.sessions == 2  # the PONG's count, two OPENs later
        assert 0.0 <= load.busy <= 1.0
    finally:
        await client.aclose()
        ctx.term()


async def test_one_unreachable_and_one_live_hub_speculates_at_once_on_the_live_one(
    running_hub: RunningHub, llama_target: models.LoadedModel
) -> None:
    from procs import free_port

    dead = f"tcp://127.0.0.1:{free_port()}"
    ctx = transport.new_context()
    pool = HubPool.create(ctx, (dead, running_hub.endpoint), _info(llama_target))
    backend = TorchBackend(llama_target)
    batcher = Batcher(backend)
    prompts = [[5, 17, 33, 8], [1, 2], list(range(40, 50))]
    seqs = [TargetSequence(backend, p, SamplingParams(), 30) for p in prompts]
    try:
        assert await pool.connect(timeout=2.0) == 1
        # a long deadline: any standalone step here would mean the sequence waited on the dead hub
        await asyncio.gather(
            *(generate_speculative(pool, s, 4, batcher, Fallback(5.0)) for s in seqs)
        )
    finally:
        await pool.aclose()
        await batcher.aclose()
        ctx.term()
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.generated == _reference(llama_target, prompt, 30)
        assert seq.stats.rounds > 0 and seq.stats.standalone_steps == 0
    assert [c.placement.placed for c in pool.clients] == [0, 3]


async def test_a_hub_that_refuses_is_left_out_and_the_other_serves(
    running_hub: RunningHub, llama_target: models.LoadedModel, tmp_path: Path
) -> None:
    from tiny_models import build_pair, build_tokenizer

    _, foreign_draft = build_pair(tmp_path, tokenizer=build_tokenizer(300, "a foreign corpus"))
    other, task, hub_ctx = await _start_hub(foreign_draft)  # another vocabulary: refuses us
    ctx = transport.new_context()
    pool = HubPool.create(ctx, (other.endpoint, running_hub.endpoint), _info(llama_target))
    try:
        assert await pool.connect(timeout=5.0) == 1
        assert [c.endpoint for c in pool.clients] == [running_hub.endpoint]
    finally:
        await pool.aclose()
        ctx.term()
        await _stop_hub(other, task, hub_ctx)


async def test_sequences_move_to_the_surviving_hub_without_losing_a_token(
    llama_pair: tuple[Path, Path], llama_target: models.LoadedModel
) -> None:
    hubs = [await _start_hub(llama_pair[1], heartbeat_s=0.2) for _ in range(2)]
    ctx = transport.new_context()
    pool = HubPool.create(ctx, tuple(h[0].endpoint for h in hubs), _info(llama_target))
    backend = TorchBackend(llama_target)
    batcher = Batcher(backend)
    prompts = [[5, 17, 33, 8], [1, 2], list(range(40, 50)), [9, 9, 9], [60, 3]]
    seqs = [TargetSequence(backend, p, SamplingParams(), 80) for p in prompts]
    try:
        await pool.connect(timeout=5.0)
        runs = asyncio.gather(
            *(generate_speculative(pool, s, 4, batcher, Fallback(2.0)) for s in seqs)
        )
        while min(s.stats.rounds for s in seqs) < 2:
            await asyncio.sleep(0.01)
        doomed = next(h for h in hubs if h[0].sessions)
        on_doomed = len(doomed[0].sessions)
        await _stop_hub(*doomed)  # drains: its targets hear SHUTTING_DOWN
        await asyncio.wait_for(runs, 120)
    finally:
        await pool.aclose()
        await batcher.aclose()
        ctx.term()
        for hub in hubs:
            if not hub[1].done():
                await _stop_hub(*hub)
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.generated == _reference(llama_target, prompt, 80)
    moved = [s for s in seqs if s.stats.moves]
    assert 0 < len(moved) <= on_doomed  # (one may finish during the drain)
    assert all(s.stats.as_dict(80)["standalone_after_move"] == 0 for s in moved)


def test_pong_load_fields_round_trip_and_stay_off_the_wire_at_zero() -> None:
    # An old peer reads a PONG without load (decoders refuse unknown keys): sparse fields.
    bare = protocol.encode(Pong(7))
    assert b"busy" not in bytes(bare[0])
    loaded = protocol.decode(protocol.encode(Pong(7, b"e" * 8, sessions=3, queue=2, busy=0.5)))
    assert loaded == Pong(7, b"e" * 8, 3, 2, 0.5)
    assert np.isclose(loaded.busy, 0.5)


async def test_a_hub_that_comes_back_gets_new_sessions_again(
    llama_pair: tuple[Path, Path], llama_target: models.LoadedModel
) -> None:
    """Catches a pool that drops a hub for good once it was lost: after its client is marked
    down (as on a missed lease) no session goes there, and once the client's liveness loop has
    been welcomed again, new sessions do."""
    hubs = [await _start_hub(llama_pair[1], heartbeat_s=0.2) for _ in range(2)]
    ctx = transport.new_context()
    pool = HubPool.create(ctx, tuple(h[0].endpoint for h in hubs), _info(llama_target))
    try:
        assert await pool.connect(timeout=5.0) == 2
        lost, other = pool.clients
        lost.mark_down("test: as if its lease ran out")
        assert {pool.pick() for _ in range(4)} == {other}
        deadline = time.monotonic() + 5
        while not lost.up and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert lost.up and lost.generation == 2  # welcomed again by its HELLO loop
        assert lost in {pool.pick() for _ in range(4)}
    finally:
        await pool.aclose()
        ctx.term()
        for hub in hubs:
            await _stop_hub(*hub)
