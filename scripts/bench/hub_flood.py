"""The hub's own serial cost per round: a null-drafter hub flooded by N sessions at once.

    python -m scripts.bench.hub_flood [--draft models/starsd-draft] [--sessions 1,16,64,128]
        [--seconds 3] [--out results/hub-flood.json]

Starts ``python -m starsd.hub --draft-kind null`` (every message path of a round, no model
work) and, per ``--sessions`` S, opens S sessions on S DEALER connections of this one process
(each its own connection, as targets have) and keeps every one in flight: each PROPOSAL is
answered at once by the next DRAFT. Over ``--seconds`` after a 1 s warm-up it counts rounds and
reads the hub process's CPU time per thread from /proc (Linux): the Python threads (event loop
and drafting thread: what one GIL serialises) apart from ZeroMQ's I/O threads. Per S it prints
and writes rounds a second, the hub's Python CPU milliseconds per round (the serial cost a
round adds to the hub however many cores it has) and this client's.

That serial cost is what a hub's message path can carry: 1 / (Python CPU per round) rounds a
second. It is measured here because the plan (``starsd plan``) has no input for it, and replays
on a small machine can run short of CPU long before the hub does (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from scripts.bench.common import NULL_HUB_ARGS
from scripts.bench.harness import Processes, start_hub
from starsd import models, protocol
from starsd.protocol import Draft, Hello, Open, Opened, Proposal, SamplingParams, Welcome

WARMUP_S = 1.0
_ZMQ_THREAD = "ZMQbg/"  # libzmq names its I/O and reaper threads so


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid`` (user + system), by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        out[f"{comm}:{tid}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def python_cpu_s(before: dict[str, float], after: dict[str, float]) -> tuple[float, float]:
    """(Python threads', ZeroMQ threads') CPU seconds between two readings."""
    spent = {k: v - before.get(k, 0.0) for k, v in after.items()}
    zmq_s = sum(v for k, v in spent.items() if k.startswith(_ZMQ_THREAD))
    return sum(spent.values()) - zmq_s, zmq_s


class Flood:
    """S sessions on S connections to one hub, every one kept in flight."""

    def __init__(self, endpoint: str, hello: Hello, sessions: int) -> None:
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.state: dict[zmq.Socket, list] = {}  # socket -> [tag, last proposal seq]
        for _ in range(sessions):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self.state[sock] = self._open(sock, hello)
            self.poller.register(sock, zmq.POLLIN)

    @staticmethod
    def _open(sock: zmq.Socket, hello: Hello) -> list:
        sock.send_multipart(protocol.encode(hello))
        if not isinstance(welcome := protocol.decode(sock.recv_multipart()), Welcome):
            raise RuntimeError(f"hub refused HELLO: {welcome}")
        sock.send_multipart(
            protocol.encode(Open(1, np.array([1, 2, 3], np.int32), SamplingParams(), 4))
        )
        opened, first = (
            protocol.decode(sock.recv_multipart()),
            protocol.decode(sock.recv_multipart()),
        )
        if not isinstance(opened, Opened) or not isinstance(first, Proposal):
            raise RuntimeError(f"hub refused OPEN: {opened}")
        return [opened.tag, first.seq]

    def _ask(self, sock: zmq.Socket) -> None:
        tag, seq = self.state[sock]
        sock.send_multipart(protocol.encode(Draft(tag, seq + 1, 2, np.array([5], np.int32))))

    def run(self, seconds: float) -> int:
        """Rounds completed in ``seconds`` (the rounds still out are collected after)."""
        for sock in self.state:
            self._ask(sock)
        rounds, end = 0, time.perf_counter() + seconds
        while (now := time.perf_counter()) < end:
            for sock, _ in self.poller.poll(100):
                reply = protocol.decode(sock.recv_multipart())
                if not isinstance(reply, Proposal):
                    raise RuntimeError(f"hub answered a DRAFT with {reply}")
                self.state[sock][1] = reply.seq
                rounds += 1
                if now < end:
                    self._ask(sock)
        self._collect()
        return rounds

    def _collect(self) -> None:
        quiet_until = time.perf_counter() + 0.5
        while time.perf_counter() < quiet_until:
            for sock, _ in self.poller.poll(50):
                self.state[sock][1] = protocol.decode(sock.recv_multipart()).seq

    def close(self) -> None:
        for sock in self.state:
            sock.close()
        self.ctx.term()


def rounds_per_s(endpoint: str, hello: Hello, sessions: int, seconds: float) -> float:
    """What the hub at ``endpoint`` carries: rounds a second with ``sessions`` always in
    flight, after the warm-up (the inverse is its serial cost per round)."""
    flood = Flood(endpoint, hello, sessions)
    try:
        flood.run(WARMUP_S)
        return flood.run(seconds) / seconds
    finally:
        flood.close()


def measure(endpoint: str, pid: int, hello: Hello, sessions: int, seconds: float) -> dict:
    """One flood of ``sessions``: rounds a second and CPU milliseconds per round."""
    flood = Flood(endpoint, hello, sessions)
    try:
        flood.run(WARMUP_S)
        before, client_before = thread_cpu_s(pid), time.process_time()
        rounds = flood.run(seconds)
        python_s, zmq_s = python_cpu_s(before, thread_cpu_s(pid))
        client_s = time.process_time() - client_before
    finally:
        flood.close()
    return {
        "sessions": sessions,
        "rounds_per_s": rounds / seconds,
        "hub_python_cpu_ms_per_round": 1e3 * python_s / rounds,
        "hub_zmq_cpu_ms_per_round": 1e3 * zmq_s / rounds,
        "client_cpu_ms_per_round": 1e3 * client_s / rounds,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """argparse (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--draft", default="models/starsd-draft")
    p.add_argument("--sessions", default="1,16,64,128")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--out", default="results/hub-flood.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Flood a null-drafter hub at each session count; print and write the figures."""
    args = parse_args(argv)
    info = models.load_tokenizer_info(args.draft)
    hello = Hello("flood", info.vocab_size, info.tokenizer_fingerprint)
    procs, floods = Processes(), []
    with tempfile.TemporaryDirectory(prefix="starsd-flood-") as scratch:
        try:
            proc, endpoint = start_hub(procs, args.draft, Path(scratch) / "hub.log", *NULL_HUB_ARGS)
            for sessions in (int(s) for s in args.sessions.split(",")):
                floods.append(measure(endpoint, proc.pid, hello, sessions, args.seconds))
                print(report_line(floods[-1]), flush=True)
        finally:
            procs.stop_all()
    report: dict[str, Any] = {
        "config": vars(args),
        "machine_cpus": os.cpu_count(),
        "floods": floods,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def report_line(flood: dict) -> str:
    """One flood's figures in one line."""
    return (
        f"hub flood: {flood['sessions']} sessions, {flood['rounds_per_s']:.0f} rounds/s, hub "
        f"Python CPU {flood['hub_python_cpu_ms_per_round']:.3f} ms a round (ZeroMQ threads "
        f"{flood['hub_zmq_cpu_ms_per_round']:.3f}), client {flood['client_cpu_ms_per_round']:.3f}"
    )


if __name__ == "__main__":
    sys.exit(main())
