"""Network emulation for the LAN benchmark: the netem command, its self-check, proxy launcher.

This kernel has no ``netem`` qdisc, so delay and bandwidth are emulated in user space by the two
modules beside this one:

* netem_proxy.py: :class:`~scripts.emulate.netem_proxy.DelayProxy`, a TCP forwarding proxy that
  delays every chunk ``delay_ms`` per direction and caps each direction's bandwidth (any byte
  stream, ZeroMQ's ZMTP included);
* netem_namespaces.py: :class:`~scripts.emulate.netem_namespaces.Namespaces`, an emulated LAN of
  one "hub" and N "target" network namespaces on a bridge, addressed from 10.77.0.0/24; nothing is
  created in the root namespace and everything is removed on exit.

This module is their command line (:func:`proxy_argv` starts the proxy as a process, e.g. in a
namespace) and the measurements its self-check and the tests make (echo server, RTT, throughput).

Standalone use::

    python -m scripts.emulate.netem proxy --listen 127.0.0.1:6000 --upstream 127.0.0.1:5555 \\
        --delay-ms 5 --rate-mbit 100
    python -m scripts.emulate.netem check      # self-check: proxy delay and rate, namespaces
    python -m scripts.emulate.netem cleanup    # remove namespaces left behind by dead runs

The proxy logs ``netem proxy listening on HOST:PORT -> HOST:PORT`` (stderr) once it accepts
connections, which a harness can wait for; SIGINT or SIGTERM stop it and log a byte summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from scripts.emulate.netem_namespaces import Namespaces, available, cleanup_stale, list_netns
from scripts.emulate.netem_proxy import DelayProxy, ProxyConfig

# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def proxy_argv(config: ProxyConfig, python: str = sys.executable) -> list[str]:
    """The command line that runs ``config`` as a subprocess (e.g. inside a namespace)."""
    return [
        python,
        "-m",
        "scripts.emulate.netem",
        "proxy",
        "--listen",
        f"{config.listen_host}:{config.listen_port}",
        "--upstream",
        f"{config.upstream_host}:{config.upstream_port}",
        "--delay-ms",
        f"{config.delay_ms:g}",
        "--rate-mbit",
        f"{config.rate_mbit:g}",
        "--max-buffer-kib",
        str(config.max_buffer_bytes // 1024),
        "--burst-bytes",
        str(config.burst_bytes),
        "--spin-ms",
        f"{config.spin_ms:g}",
    ]


def parse_hostport(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class CliArgs:
    """Parsed command line."""

    command: str
    proxy: ProxyConfig | None
    log_level: str


def parse_args(argv: Sequence[str] | None = None) -> CliArgs:
    """Parse the command line into :class:`CliArgs`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    proxy = sub.add_parser("proxy", help="run a delay/bandwidth proxy until SIGINT/SIGTERM")
    proxy.add_argument("--listen", type=parse_hostport, required=True, metavar="HOST:PORT")
    proxy.add_argument("--upstream", type=parse_hostport, required=True, metavar="HOST:PORT")
    proxy.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per direction")
    proxy.add_argument("--rate-mbit", type=float, default=0.0, help="per direction, 0 = no cap")
    proxy.add_argument("--max-buffer-kib", type=int, default=8192, help="per direction")
    proxy.add_argument("--burst-bytes", type=int, default=0, help="may pass ahead of the rate")
    proxy.add_argument("--spin-ms", type=float, default=1.0, help="busy-wait before each due time")
    sub.add_parser("check", help="self-check: proxy delay and rate, namespaces")
    sub.add_parser("cleanup", help="delete namespaces left behind by dead runs")
    ns = parser.parse_args(argv)
    config = None
    if ns.command == "proxy":
        config = ProxyConfig(
            listen_host=ns.listen[0],
            listen_port=ns.listen[1],
            upstream_host=ns.upstream[0],
            upstream_port=ns.upstream[1],
            delay_ms=ns.delay_ms,
            rate_mbit=ns.rate_mbit,
            max_buffer_bytes=ns.max_buffer_kib * 1024,
            burst_bytes=ns.burst_bytes,
            spin_ms=ns.spin_ms,
        )
    return CliArgs(ns.command, config, ns.log_level.upper())


async def _serve_until_signal(config: ProxyConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    proxy = DelayProxy(config)
    await proxy.start()
    sys.stderr.flush()
    await stop.wait()
    await proxy.stop()


# -- self-check -------------------------------------------------------------------------------


class _EchoServer:
    """A TCP echo server on a daemon thread (one connection at a time), for checks and tests."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_server((host, 0))
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._serve, name="netem-echo", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                with conn:
                    while data := conn.recv(65536):
                        conn.sendall(data)

    def close(self) -> None:
        """Stop accepting (shutdown wakes the blocked accept()) and join the thread."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(2.0)


def measure_rtt(host: str, port: int, rounds: int = 5, timeout_s: float = 5.0) -> float:
    """Median seconds for a 1-byte request/response echo through ``host:port``."""
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        samples = []
        for _ in range(rounds):
            start = time.perf_counter()
            conn.sendall(b"x")
            if conn.recv(1) != b"x":
                raise ConnectionError("echo returned the wrong byte")
            samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def measure_throughput(host: str, port: int, n_bytes: int, timeout_s: float = 10.0) -> float:
    """Seconds to push ``n_bytes`` through an echo at ``host:port`` and read them all back."""
    payload = b"\0" * n_bytes
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        start = time.perf_counter()
        sender = threading.Thread(target=conn.sendall, args=(payload,), daemon=True)
        sender.start()
        received = 0
        while received < n_bytes:
            chunk = conn.recv(1 << 20)
            if not chunk:
                raise ConnectionError("connection closed early")
            received += len(chunk)
        elapsed = time.perf_counter() - start
        sender.join(timeout_s)
    return elapsed


def self_check() -> bool:
    """Measure the proxy on loopback and try the namespaces; print results, return success."""
    server = _EchoServer()
    host, port = server.address
    ok = True
    try:
        base = measure_rtt(host, port)
        with DelayProxy(ProxyConfig(host, port, delay_ms=20)) as proxy:
            rtt = measure_rtt(*proxy.address)
        good = 0.040 <= rtt < 0.060
        ok &= good
        print(f"rtt: direct {base * 1e3:.2f} ms, via 20 ms proxy {rtt * 1e3:.2f} ms  [{good}]")
        with DelayProxy(ProxyConfig(host, port, rate_mbit=40)) as proxy:
            elapsed = measure_throughput(*proxy.address, 2_000_000)
        # The echo crosses the proxy twice, each way capped at 40 Mbit/s, pipelined: ~0.4 s.
        good = 0.3 <= elapsed <= 0.5
        ok &= good
        print(f"rate: 2 MB echoed at 40 Mbit/s in {elapsed:.3f} s (expect 0.40)  [{good}]")
    finally:
        server.close()
    usable, reason = available()
    print(f"namespaces available: {usable} ({reason})")
    if usable:
        with Namespaces(2) as lan:
            done = lan.run(lan.targets[0], [sys.executable, "-c", "import socket"])
            print(f"namespaces: {lan.names} created, python runs inside: {done.returncode == 0}")
        left = set(lan.names) & set(list_netns())
        ok &= not left
        print(f"namespaces removed: {not left}")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``proxy``, ``check`` or ``cleanup``."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    if args.command == "proxy":
        assert args.proxy is not None
        asyncio.run(_serve_until_signal(args.proxy))
        return 0
    if args.command == "cleanup":
        print("removed:", " ".join(cleanup_stale()) or "nothing")
        return 0
    return 0 if self_check() else 1


if __name__ == "__main__":
    sys.exit(main())
