"""Real processes for end-to-end and fault tests: hubs, targets, reference outputs."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from starsd import models

REPO = Path(__file__).resolve().parent.parent
STARTED: list[subprocess.Popen] = []  # every process started here, so a failed test can't leak


def kill_leftovers() -> None:
    """SIGKILL every process this module started that is still running (or stopped)."""
    for proc in STARTED:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(10)
    STARTED.clear()


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "STARSD_LOG": "INFO"}


def free_port() -> int:
    """A loopback port nobody listens on now (a restarted hub must come back on the same one)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class HubProcess:
    """``python -m starsd.hub`` on loopback, its endpoint read from its log."""

    def __init__(
        self, draft_dir: Path, log_path: Path, *extra: str, bind: str = "tcp://127.0.0.1:*"
    ) -> None:
        self.log_path = log_path
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "starsd.hub",
                "--model",
                str(draft_dir),
                "--bind",
                bind,
                "--stats-interval",
                "1",
                *extra,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=ENV,
            cwd=REPO,
        )
        STARTED.append(self.proc)
        self.endpoint = wait_for(log_path, r"hub listening on (tcp://\S+)", self.proc)

    def text(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()


class TargetProcess:
    """``python -m edge.target`` over a JSONL of prompts, logging to a file."""

    def __init__(
        self,
        endpoint: str,
        target_dir: Path,
        prompts: Path,
        out: Path,
        *extra: str,
        max_new_tokens: int = 24,
    ) -> None:
        self.out = out
        self.target_dir = target_dir
        self.log_path = out.with_suffix(".log")
        self.cmd = target_cmd(
            endpoint, target_dir, prompts, out, "--max-new-tokens", str(max_new_tokens), *extra
        )
        self.start()

    def start(self) -> None:
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=REPO
            )
        STARTED.append(self.proc)

    def text(self) -> str:
        return self.log_path.read_text()

    def wait(self, timeout: float = 180) -> list[dict]:
        assert self.proc.wait(timeout=timeout) == 0, self.text()[-4000:]
        return read_jsonl(self.out)


def target_cmd(endpoint: str, target_dir: Path, prompts: Path, out: Path, *extra: str) -> list:
    return [
        sys.executable,
        "-m",
        "edge.target",
        "--hub",
        endpoint,
        "--model",
        str(target_dir),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--max-new-tokens",
        "24",
        *extra,
    ]


def wait_for(
    log: Path, pattern: str, proc: subprocess.Popen | None = None, timeout: float = 60.0
) -> str:
    """First group of ``pattern`` once it is in ``log`` (fails if ``proc`` exits first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text())
        if found:
            return found.group(1) if found.groups() else found.group(0)
        assert proc is None or proc.poll() is None, log.read_text()[-4000:]
        time.sleep(0.02)
    raise TimeoutError(f"{pattern!r} not in {log}:\n{log.read_text()[-4000:]}")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def reference(target_dir: Path, prompt: str, n: int) -> list[int]:
    """Greedy tokens of the target alone (transformers generate, float32)."""
    target = models.load_causal_lm(target_dir)
    ids = torch.tensor([models.encode_text(target, prompt)])
    out = target.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=sorted(target.eos_token_ids),
        pad_token_id=0,
    )
    return out[0, ids.shape[1] :].tolist()
