"""Fault suite with real processes: the hub keeps serving, and no target loses or changes a token.

Every case runs one hub and real target processes on loopback with the tiny Llama pair (greedy,
float32) and checks every output against the target alone, token for token. Heartbeats are short
(0.3 s, lease 0.9 s) so detection is quick; each test is bounded by its timeouts.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import RawTarget
from greedy import assert_greedy
from procs import HubProcess, TargetProcess, read_jsonl, reference, wait_for
from tiny_models import build_pair

from scripts.bench.harness import write_prompts
from scripts.emulate.netem_proxy import DelayProxy, ProxyConfig
from starsd.protocol import Stats, StatsRequest

pytestmark = pytest.mark.slow

HEARTBEAT = ("--heartbeat-s", "0.3")
LONG = 100  # new tokens per prompt: long enough for a fault to land mid-stream
PROMPTS = [
    "To be, or not to be",
    "Now is the winter",
    "All the world",
    "whether tis nobler",
    "the slings and arrows of",
    "O",
    "Friends, Romans",
    "Once more unto",
]
TARGET_ARGS = ("--deadline-ms", "300", "--resync-s", "2")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_pair(tmp_path_factory.mktemp("faults"), "llama")


@pytest.fixture(scope="module")
def expected(pair: tuple[Path, Path]) -> dict[str, list[int]]:
    return {p: reference(pair[0], p, LONG) for p in PROMPTS}


def _target(
    tmp_path: Path,
    name: str,
    endpoint: str,
    pair: tuple[Path, Path],
    prompts: list[str],
    *extra: str,
) -> TargetProcess:
    jsonl = write_prompts(tmp_path / f"{name}.in.jsonl", prompts)
    return TargetProcess(
        endpoint,
        pair[0],
        jsonl,
        tmp_path / f"{name}.jsonl",
        *TARGET_ARGS,
        *extra,
        max_new_tokens=LONG,
    )


def _check(target: TargetProcess, expected: dict[str, list[int]]) -> list[dict]:
    """Wait for ``target``; its rows, each equal to the target alone.

    Catches a target that loses a sequence as well as one that changes a token: without the
    row count, a target that wrote no rows at all passed.
    """
    rows = target.wait()
    given = read_jsonl(Path(target.cmd[target.cmd.index("--prompts") + 1]))
    assert [r["prompt"] for r in rows] == [g["prompt"] for g in given]
    for row in rows:
        assert_greedy(target.target_dir, row["prompt"], row["token_ids"], expected[row["prompt"]])
    return rows


def _since(log: str, pattern: str) -> float:
    """Seconds since the first log line matching ``pattern`` (logging's asctime, ms resolution)."""
    line = next(ln for ln in log.splitlines() if re.search(pattern, ln))
    stamp = time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")
    return time.time() - (time.mktime(stamp) + int(line[20:23]) / 1000)


def test_killed_and_hung_targets_are_freed_and_others_stay_exact(
    tmp_path: Path, pair: tuple[Path, Path], expected: dict[str, list[int]]
) -> None:
    hub = HubProcess(pair[1], tmp_path / "hub.log", *HEARTBEAT)
    bystanders = [_target(tmp_path, f"b{i}", hub.endpoint, pair, PROMPTS[i::2]) for i in range(2)]
    killed = _target(tmp_path, "killed", hub.endpoint, pair, PROMPTS * 3)
    hung = _target(tmp_path, "hung", hub.endpoint, pair, PROMPTS * 3)
    for victim in (killed, hung):
        wait_for(victim.log_path, r"connected to hub", victim.proc)
    time.sleep(0.5)  # mid-stream: sequences are open and rounds in flight
    killed.proc.send_signal(signal.SIGKILL)
    hung.proc.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        wait_for(hub.log_path, r"(?s)lease expired.*lease expired", hub.proc, timeout=10)
        freed_after = time.monotonic() - stopped_at
        assert freed_after < 3 * 0.3 + 2.0, freed_after  # 3 heartbeats, plus the reaper's tick
        rates = []
        for b in bystanders:
            rates += [r["stats"]["tokens_per_s"] for r in _check(b, expected)]
        print(
            f"\n[fault] dead and hung targets freed after {freed_after:.2f} s; "
            f"bystander tok/s per sequence, in order: {rates}"
        )
    finally:
        hung.proc.send_signal(signal.SIGCONT)
    # The hung target wakes up without its sessions: it rejoins, re-opens, and is still exact.
    _check(hung, expected)
    assert "generation 2" in hung.text()
    # A restarted target (same prompts) is served like any other.
    killed.start()
    _check(killed, expected)
    assert hub.stop() == 0


def test_hub_killed_and_restarted_targets_fall_back_then_resume(
    tmp_path: Path, pair: tuple[Path, Path], expected: dict[str, list[int]]
) -> None:
    # The targets reach the hub through one address (a pass-through proxy). The replacement hub
    # is started first, on another port, so the test does not wait for its model load; the
    # proxy then sends new connections to it, as a restarted hub at the same address would.
    hub = HubProcess(pair[1], tmp_path / "hub1.log", *HEARTBEAT)
    hub2 = HubProcess(pair[1], tmp_path / "hub2.log", *HEARTBEAT)
    with _relay(_port(hub.endpoint)) as relay:
        targets = [
            _target(tmp_path, f"t{i}", f"tcp://127.0.0.1:{relay.address[1]}", pair, PROMPTS * 2)
            for i in range(2)
        ]
        for t in targets:
            wait_for(t.log_path, r"connected to hub", t.proc)
        time.sleep(0.5)
        hub.stop(signal.SIGKILL)
        relay.retarget(_port(hub2.endpoint))
        moved = time.monotonic()
        for t in targets:
            wait_for(t.log_path, r"generation 2", t.proc, timeout=15)
        print(
            f"\n[fault] targets resumed with the new hub {time.monotonic() - moved:.2f} s "
            "after it became reachable"
        )
        rows = [row for t in targets for row in _check(t, expected)]
        assert sum(r["stats"]["standalone_steps"] for r in rows) > 0
    assert _hub_stats(hub2.endpoint).jobs > 0  # the targets returned to speculation
    hub2.stop()


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _hub_stats(endpoint: str) -> Stats:
    """The hub's STATS reply (asked without HELLO, so the asker is no target)."""

    async def ask() -> Stats:
        raw = RawTarget(endpoint)
        try:
            reply = await raw.ask(StatsRequest(1))
        finally:
            raw.close()
        assert isinstance(reply, Stats), reply
        return reply

    return asyncio.run(ask())


def _relay(upstream_port: int, delay_ms: float = 0.0) -> DelayProxy:
    """A loopback relay to ``upstream_port`` (no busy-wait: the delay need not be exact)."""
    return DelayProxy(ProxyConfig("127.0.0.1", upstream_port, delay_ms=delay_ms, spin_ms=0))


def test_hub_sigterm_drains_and_targets_finish_alone(
    tmp_path: Path, pair: tuple[Path, Path], expected: dict[str, list[int]]
) -> None:
    hub = HubProcess(pair[1], tmp_path / "hub.log", *HEARTBEAT)
    targets = [_target(tmp_path, f"t{i}", hub.endpoint, pair, PROMPTS) for i in range(2)]
    for t in targets:
        wait_for(t.log_path, r"connected to hub", t.proc)
    time.sleep(0.5)
    started = time.monotonic()
    assert hub.stop(signal.SIGTERM, timeout=15) == 0
    assert time.monotonic() - started < 5 + 3  # the drain timeout, plus start-up slack
    assert "draining" in hub.text() and "hub stopped" in hub.text()
    for t in targets:
        _check(t, expected)
        assert "SHUTTING_DOWN" in t.text()


def test_delayed_link_with_drops(
    tmp_path: Path, pair: tuple[Path, Path], expected: dict[str, list[int]]
) -> None:
    hub = HubProcess(pair[1], tmp_path / "hub.log", *HEARTBEAT)
    with _relay(_port(hub.endpoint), delay_ms=2) as link:
        endpoint = f"tcp://127.0.0.1:{link.address[1]}"
        targets = [_target(tmp_path, f"t{i}", endpoint, pair, PROMPTS * 2) for i in range(2)]
        for t in targets:
            wait_for(t.log_path, r"connected to hub", t.proc)
        for _ in range(3):  # drop the link three times while the targets decode
            time.sleep(0.7)
            link.cut()
        for t in targets:
            _check(t, expected)
        assert link.cuts >= 2
    assert hub.stop() == 0
