"""Hostile peers against a live hub on loopback: attacker processes and the probe of their cost.

    python -m scripts.hostile.hostile probe [--quick] [--out results/hostile.json]
    python -m scripts.hostile.hostile attack NAME --endpoint E --vocab V --tokenizer F [--seconds S]

``probe`` starts a hub on the committed draft, then for each attack measures the hub's RSS
growth (peak during the attack over the level before it) and a legitimate target's tokens/s
with the attack running over its tokens/s without, alternated (quiet, attack, quiet, attack)
because this machine's speed drifts. Attackers run as separate processes at nice 19: on two
cores an attacker at full priority measures CPU contention between processes, not the hub.

Attacks (numbers as in the issue that found them):
  churn   3  OPEN then CLOSE at once, as fast as the hub answers
  context 4  a DRAFT refused with CONTEXT_FULL, re-sent again and again
  hog     5  several connections each opening every session the hub grants
  flood   6  connections sending PINGs and never reading a reply
Every attack is bounded in time (``--seconds``) and in messages.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import zmq

from starsd import protocol
from starsd.protocol import Close, Draft, Error, Hello, Open, Opened, Ping

if TYPE_CHECKING:  # attacker processes start without torch: the model module is for types only
    from starsd.models import LoadedModel

PROMPT = np.array([5, 17, 33, 8], dtype=np.int32)
MAX_MESSAGES = 200_000  # per attacker process, whatever --seconds says


@dataclass(frozen=True)
class Attack:
    """Where an attacker process aims and for how long."""

    endpoint: str
    vocab: int
    tokenizer: str
    seconds: float = 5.0
    connections: int = 4
    max_positions: int = 256


# ---------------------------------------------------------------------------- attacker side


def _dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.connect(endpoint)
    return sock


def _ask(sock: zmq.Socket, msg: protocol.Message, timeout_ms: int = 5000) -> protocol.Message:
    sock.send_multipart(protocol.encode(msg))
    if not sock.poll(timeout_ms):
        raise TimeoutError(f"no reply to {type(msg).__name__}")
    return protocol.decode(sock.recv_multipart())


def _welcomed(ctx: zmq.Context, a: Attack) -> zmq.Socket:
    sock = _dealer(ctx, a.endpoint)
    _ask(sock, Hello("attacker", a.vocab, a.tokenizer))
    return sock


def _open(sock: zmq.Socket, prompt: np.ndarray = PROMPT) -> bytes | None:
    """Open a session; its tag, or None when refused. Skips the session's first proposal."""
    sock.send_multipart(protocol.encode(Open(1, prompt, protocol.SamplingParams(), 4)))
    while sock.poll(5000):
        reply = protocol.decode(sock.recv_multipart())
        if isinstance(reply, Opened):
            return reply.tag
        if isinstance(reply, Error) and reply.ref == 1:
            return None
    return None


def attack_churn(ctx: zmq.Context, a: Attack) -> int:
    """Bursts of 64 OPENs, each CLOSEd as soon as its OPENED arrives (its job still queued)."""
    sock, sent = _welcomed(ctx, a), 0
    deadline = time.monotonic() + a.seconds
    while time.monotonic() < deadline and sent < MAX_MESSAGES:
        for ref in range(64):
            sock.send_multipart(protocol.encode(Open(ref, PROMPT, protocol.SamplingParams(), 4)))
        sent += 64 + _close_opened(sock, expect=64)
    return sent


def _close_opened(sock: zmq.Socket, expect: int) -> int:
    """CLOSE every session OPENED from now until ``expect`` OPEN replies came; how many."""
    closed = replies = 0
    while replies < expect and sock.poll(5000):
        reply = protocol.decode(sock.recv_multipart())
        if isinstance(reply, Opened):
            sock.send_multipart(protocol.encode(Close(reply.tag)))
            closed += 1
        replies += isinstance(reply, Opened) or (isinstance(reply, Error) and reply.ref is not None)
    return closed


def attack_context(ctx: zmq.Context, a: Attack) -> int:
    """Fill a session's context, then re-send the refused DRAFT (it must never grow)."""
    sock, sent = _welcomed(ctx, a), 0
    prompt = np.arange(a.max_positions - 8, dtype=np.int32) % a.vocab
    tag = _open(sock, prompt)
    if tag is None:
        raise RuntimeError("the hub refused the attacker's session")
    appended = np.zeros(min(protocol.MAX_APPENDED, 64), dtype=np.int32)
    deadline = time.monotonic() + a.seconds
    while time.monotonic() < deadline and sent < MAX_MESSAGES:
        sock.send_multipart(protocol.encode(Draft(tag, 1, 0, appended)))
        sent += 1
        while sock.poll(0):
            sock.recv_multipart()
    return sent


def attack_hog(ctx: zmq.Context, a: Attack) -> int:
    """Every connection opens sessions until refused, then holds them (PINGs keep the lease)."""
    socks = [_welcomed(ctx, a) for _ in range(a.connections)]
    opened = 0
    for sock in socks:
        while opened < 10_000 and _open(sock) is not None:
            opened += 1
    deadline = time.monotonic() + a.seconds
    while time.monotonic() < deadline:
        for sock in socks:
            sock.send_multipart(protocol.encode(Ping(1)))
            while sock.poll(0):
                sock.recv_multipart()
        time.sleep(0.2)
    return opened


def attack_flood(ctx: zmq.Context, a: Attack) -> int:
    """PINGs on every connection as fast as they go out; replies are never read."""
    socks = [_dealer(ctx, a.endpoint) for _ in range(a.connections)]
    ping, sent = protocol.encode(Ping(7)), 0
    deadline = time.monotonic() + a.seconds
    while time.monotonic() < deadline and sent < MAX_MESSAGES:
        for sock in socks:
            try:
                sock.send_multipart(ping, flags=zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                time.sleep(0.001)
    return sent


ATTACKS: dict[str, Callable[[zmq.Context, Attack], int]] = {
    "churn": attack_churn,
    "context": attack_context,
    "hog": attack_hog,
    "flood": attack_flood,
}


def run_attack(name: str, a: Attack) -> int:
    """One attack in this process (at nice 19); returns the messages or sessions it made."""
    os.nice(19)
    ctx = zmq.Context()
    try:
        return ATTACKS[name](ctx, a)
    finally:
        ctx.destroy(linger=0)


# ---------------------------------------------------------------------------- measuring side


class HubDied(RuntimeError):
    """The hub process ended during an attack."""


def rss_mb(pid: int) -> float:
    """Resident set size of a process, MB; HubDied once it has exited."""
    status = Path(f"/proc/{pid}/status")
    for line in (status.read_text() if status.exists() else "").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise HubDied(f"process {pid} is gone")


async def legit_tokens_per_s(
    endpoint: str, target: LoadedModel, prompts: list[list[int]], n_tokens: int
) -> tuple[float, list[list[int]], int]:
    """A legitimate target speculating ``prompts`` at once: (tokens/s, outputs, standalone
    steps)."""
    from edge.backends.torch import TorchBackend
    from edge.batcher import Batcher
    from edge.client import HubClient
    from edge.handshake import TargetInfo
    from edge.speculate import generate_speculative
    from edge.verifier import TargetSequence
    from starsd import transport

    ctx = transport.new_context()
    info = TargetInfo("legit", target.vocab_size, target.tokenizer_fingerprint)
    backend = TorchBackend(target)
    client, batcher = HubClient(ctx, endpoint, info), Batcher(backend)
    seqs = [TargetSequence(backend, p, protocol.SamplingParams(), n_tokens) for p in prompts]
    try:
        await client.connect()
        started = time.perf_counter()
        await asyncio.gather(*(generate_speculative(client, s, 4, batcher) for s in seqs))
        wall = time.perf_counter() - started
    finally:
        await client.aclose()
        await batcher.aclose()
        ctx.term()
    outputs = [s.generated for s in seqs]
    return sum(map(len, outputs)) / wall, outputs, sum(s.stats.standalone_steps for s in seqs)


@dataclass
class Outcome:
    """What one attack did: hub RSS growth and the legitimate target's throughput ratio."""

    attack: str
    rss_growth_mb: float
    quiet_tok_s: list[float]
    attacked_tok_s: list[float]
    outputs_identical: bool
    attacker_count: int
    hub_died: bool = False
    attacked_standalone_steps: int = 0  # tokens the legitimate target decoded without the hub

    @property
    def ratio(self) -> float:
        if self.hub_died or not self.attacked_tok_s:
            return 0.0
        return statistics.median(self.attacked_tok_s) / statistics.median(self.quiet_tok_s)


def attacker_cmd(name: str, a: Attack) -> list[str]:
    """The command line of one attacker process."""
    return [
        sys.executable,
        "-m",
        "scripts.hostile.hostile",
        "attack",
        name,
        "--endpoint",
        a.endpoint,
        "--vocab",
        str(a.vocab),
        "--tokenizer",
        a.tokenizer,
        "--seconds",
        str(a.seconds),
        "--connections",
        str(a.connections),
        "--max-positions",
        str(a.max_positions),
    ]


async def measure(
    name: str, a: Attack, hub_pid: int, legit: Callable, reference: list, rounds: int = 2
) -> Outcome:
    """Alternate quiet and attacked runs of ``legit`` (``rounds`` each) around one attack
    process per attacked run; track the hub's peak RSS while attacks run."""
    quiet, attacked, identical, count, alone = [], [], True, 0, 0
    peak = base = rss_mb(hub_pid)
    for _ in range(rounds):
        tok_s, outputs, _ = await legit()
        quiet.append(tok_s)
        identical &= outputs == reference
        proc = await asyncio.create_subprocess_exec(
            *attacker_cmd(name, a), stdout=asyncio.subprocess.PIPE
        )
        await asyncio.sleep(min(1.0, a.seconds / 4))  # the attack gets going first
        run = asyncio.create_task(legit())
        while not run.done() or proc.returncode is None:
            peak = max(peak, rss_mb(hub_pid))
            await asyncio.sleep(0.05)
            if run.done() and proc.returncode is None:
                await asyncio.wait_for(proc.wait(), a.seconds + 30)
        tok_s, outputs, steps = run.result()
        attacked.append(tok_s)
        alone += steps
        identical &= outputs == reference
        count += int((await proc.stdout.read()).decode().strip() or 0)  # type: ignore[union-attr]
    return Outcome(
        name, peak - base, quiet, attacked, identical, count, attacked_standalone_steps=alone
    )


def probe(args: argparse.Namespace) -> int:
    """Hub + legitimate target + each attack in turn; prints and writes the figures."""
    from scripts.bench import harness
    from starsd import models

    target = models.load_causal_lm(models.TOY_TARGET_DIR)
    prompts = [models.encode_text(target, p) for p in harness.PROMPTS[:4]]
    procs, out_dir = harness.Processes(), Path(args.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        # --hub-repo: the hub from another checkout (e.g. an older commit, for a before/after)
        old = args.hub_repo
        prefix = ["env", "-C", old, f"PYTHONPATH={old}"] if old else None
        hub, endpoint = harness.start_hub(
            procs, str(models.TOY_DRAFT_DIR), out_dir / "hostile-hub.log", prefix=prefix
        )
        outcomes = asyncio.run(_probe_all(args, endpoint, hub.pid, target, prompts))
    finally:
        procs.stop_all()
    for o in outcomes:
        if o.hub_died:
            print(f"{o.attack:8s} THE HUB DIED")
            continue
        print(
            f"{o.attack:8s} hub RSS +{o.rss_growth_mb:6.1f} MB   legit {o.ratio:.2f}x of quiet "
            f"(quiet {statistics.median(o.quiet_tok_s):.1f}, attacked "
            f"{statistics.median(o.attacked_tok_s):.1f} tok/s, {o.attacked_standalone_steps} "
            f"tokens without the hub)   identical="
            f"{'yes' if o.outputs_identical else 'NO'}   attacker made {o.attacker_count}"
        )
    Path(args.out).write_text(
        json.dumps([{**vars(o), "ratio": o.ratio} for o in outcomes], indent=1)
    )
    return 0 if all(o.outputs_identical for o in outcomes) else 1


async def _probe_all(
    args: argparse.Namespace,
    endpoint: str,
    hub_pid: int,
    target: LoadedModel,
    prompts: list[list[int]],
) -> list[Outcome]:
    n_tokens = 24 if args.quick else 48
    legit = lambda: legit_tokens_per_s(endpoint, target, prompts, n_tokens)  # noqa: E731
    _, reference, _ = await legit()  # warm-up, and the outputs every later run must repeat
    a = Attack(
        endpoint,
        target.vocab_size,
        target.tokenizer_fingerprint,
        seconds=4.0 if args.quick else 8.0,
        connections=4 if args.quick else 20,
        max_positions=target.max_positions or 256,
    )
    outcomes = []
    for name in args.attacks:
        print(f"[hostile] {name} ...", flush=True)
        try:
            outcomes.append(await measure(name, a, hub_pid, legit, reference, rounds=args.rounds))
        except (HubDied, OSError, TimeoutError) as exc:  # the hub is gone: nothing more to run
            print(f"[hostile] {name}: the hub died ({exc})", flush=True)
            outcomes.append(Outcome(name, 0.0, [], [], False, 0, hub_died=True))
            break
    return outcomes


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``probe`` or ``attack``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("probe")
    pr.add_argument("--quick", action="store_true")
    pr.add_argument("--rounds", type=int, default=2)
    pr.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    pr.add_argument("--out", default="results/hostile.json")
    pr.add_argument("--hub-repo", help="run the hub from this checkout instead of this one")
    at = sub.add_parser("attack")
    at.add_argument("name", choices=list(ATTACKS))
    for flag, kind in (
        ("--endpoint", str),
        ("--vocab", int),
        ("--tokenizer", str),
        ("--seconds", float),
        ("--connections", int),
        ("--max-positions", int),
    ):
        at.add_argument(flag, type=kind, required=flag in ("--endpoint", "--vocab", "--tokenizer"))
    args = p.parse_args(argv)
    if args.cmd == "probe":
        return probe(args)
    fields = {k: v for k, v in vars(args).items() if k in Attack.__dataclass_fields__ and v}
    print(run_attack(args.name, Attack(**fields)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
