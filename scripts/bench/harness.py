"""Process plumbing shared by the demo and the benchmarks: start, find and stop services."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from scripts.bench.pinning import pin

REPO = Path(__file__).resolve().parents[2]
# Opening lines in the default models' corpus (play-formatted Shakespeare).
PROMPTS = [
    "ROMEO:\nBut soft, what light",
    "HAMLET:\nTo be, or not to be,",
    "KING RICHARD III:\nNow is the winter",
    "JULIET:\nO Romeo, Romeo,",
    "MACBETH:\nTo-morrow, and to-morrow,",
    "PORTIA:\nThe quality of mercy",
    "First Citizen:\nBefore we proceed any further,",
    "OTHELLO:\nIt is the cause, my soul,",
    "PROSPERO:\nOur revels now are ended.",
]


class Processes:
    """Every child process a script starts, so all of them can be stopped on any exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        args: list[str],
        log_path: Path,
        prefix: list[str] | None = None,
        cpus: set[int] | None = None,
    ) -> subprocess.Popen[bytes]:
        """``python ARGS`` (optionally behind ``prefix``, e.g. ``ip netns exec NS``, and
        confined to ``cpus``)."""
        path = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [*(prefix or []), sys.executable, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
            )
        if cpus is not None:  # before the interpreter is up, so its threads inherit it
            pin(proc.pid, cpus)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        """SIGTERM everything still running, then SIGKILL what does not exit within 10 s."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def start_hub(
    procs: Processes,
    draft: str,
    log: Path,
    *extra: str,
    bind: str = "tcp://127.0.0.1:*",
    prefix: list[str] | None = None,
    cpus: set[int] | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``python -m starsd.hub`` and wait for its endpoint (read from its log)."""
    return start_hubs(procs, draft, [log], *extra, bind=bind, prefix=prefix, cpus=cpus)[0]


def start_hubs(
    procs: Processes,
    draft: str,
    logs: list[Path],
    *extra: str,
    bind: str = "tcp://127.0.0.1:*",
    prefix: list[str] | None = None,
    cpus: set[int] | None = None,
    per_hub: list[list[str]] | None = None,
) -> list[tuple[subprocess.Popen[bytes], str]]:
    """One hub per log, all loading at once; each with the endpoint it bound.

    ``per_hub`` (one list per log) adds arguments to one hub only, e.g. its ``--max-batch``.
    """
    args = ["-m", "starsd.hub", "--model", draft, "--bind", bind, *extra]
    own = per_hub or [[] for _ in logs]
    started = [
        procs.start([*args, *more], log, prefix, cpus) for log, more in zip(logs, own, strict=True)
    ]
    return [
        (proc, wait_for_line(log, r"hub listening on (tcp://\S+)", proc))
        for proc, log in zip(started, logs, strict=True)
    ]


def start_hub_set(
    procs: Processes,
    specs: dict[str, tuple[Path, list[str], set[int] | None]],
    bind: str = "tcp://127.0.0.1:*",
) -> dict[str, tuple[subprocess.Popen[bytes], str]]:
    """Hubs that differ in more than one argument (name -> (log, arguments after
    ``python -m starsd.hub --bind BIND``, CPUs)); each with its endpoint.

    They load at once on every CPU (several hubs pinned to one CPU would load one after
    another), and each is confined to its CPUs once it listens (:func:`~scripts.bench.pinning.pin`).
    """
    started = {
        name: procs.start(["-m", "starsd.hub", "--bind", bind, *args], log)
        for name, (log, args, _) in specs.items()
    }
    hubs = {
        name: (proc, wait_for_line(specs[name][0], r"hub listening on (tcp://\S+)", proc))
        for name, proc in started.items()
    }
    for name, (proc, _) in hubs.items():
        cpus = specs[name][2]
        if cpus is not None:
            pin(proc.pid, cpus)
    return hubs


def write_prompts(path: Path, prompts: Sequence[str]) -> Path:
    """``prompts`` as edge.target's input JSONL (ids 0, 1, ...) at ``path``; the path."""
    path.write_text(
        "".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts))
    )
    return path


def wait_for_line(
    log: Path, pattern: str, proc: subprocess.Popen[bytes], timeout: float = 120
) -> str:
    """First group of ``pattern`` once it appears in ``log``; raises if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text())
        if found:
            return found.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"{pattern!r} did not appear in {log} within {timeout:.0f} s")


def parse_status_kb(text: str, field: str) -> int:
    """``field`` (VmRSS, VmHWM, ...) in kB from the text of /proc/<pid>/status."""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == field:
            number, unit = value.split()
            if unit != "kB":
                raise ValueError(f"{field}: unexpected unit {unit!r}")
            return int(number)
    raise KeyError(field)


def rss_mb(pid: int | str = "self", field: str = "VmRSS") -> float:
    """A process's resident memory (or another /proc/<pid>/status field) in MiB."""
    return parse_status_kb(Path(f"/proc/{pid}/status").read_text(), field) / 1024


def stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> int:
    """SIGTERM one process and wait for its exit code."""
    proc.terminate()
    return proc.wait(timeout=timeout)


def run_suite(
    name: str, suite: Callable[[Processes, Path], dict[str, Any]]
) -> dict[str, Any] | None:
    """``suite(procs, work_dir)`` in a scratch directory, every process it started stopped at the
    end; SIGTERM and Ctrl-C stop them too (then None). The result gains ``wall_s``."""
    signal.signal(signal.SIGTERM, _interrupt)
    procs, started = Processes(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"starsd-{name}-") as tmp:
        try:
            result = suite(procs, Path(tmp))
        except KeyboardInterrupt:
            print(f"{name}: interrupted; all processes stopped", file=sys.stderr)
            return None
        finally:
            procs.stop_all()
    result["wall_s"] = time.perf_counter() - started
    return result


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops every child (and namespace), as Ctrl-C does
