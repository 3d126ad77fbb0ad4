"""Hostile hubs against real ``edge.target`` processes (the CLI and ``--serve``), on loopback.

The in-process cases are tests/test_hostile_hub.py; these check what only a process shows: that
libzmq does not abort it, that the CLI and the server end the same way (rc 0, the target's own
output) whatever the hub does, and that an HTTP server beside a flooding hub keeps answering.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from greedy import assert_greedy
from procs import ENV, REPO, STARTED, HubProcess, read_jsonl, reference, wait_for

from scripts.bench.harness import write_prompts
from scripts.hostile.fake_hub import ATTACKS, FakeHub

pytestmark = pytest.mark.slow

PROMPTS = ["To be, or not to be", "Now is the winter", "All the world"]
N = 24


@pytest.fixture(scope="module")
def expected(llama_pair: tuple[Path, Path]) -> dict[str, list[int]]:
    return {p: reference(llama_pair[0], p, N) for p in PROMPTS}


def _cli(
    hubs: str, target_dir: Path, tmp_path: Path, name: str, *extra: str
) -> tuple[subprocess.Popen, Path]:
    prompts = write_prompts(tmp_path / f"{name}.in.jsonl", PROMPTS)
    out = tmp_path / f"{name}.jsonl"
    log = (tmp_path / f"{name}.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edge.target",
            "--hub",
            hubs,
            "--model",
            str(target_dir),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--max-new-tokens",
            str(N),
            "--deadline-ms",
            "300",
            "--resync-s",
            "2",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=ENV,
        cwd=REPO,
    )
    STARTED.append(proc)
    return proc, out


CLI_ATTACKS = [
    "oov-tokens",
    "opened-twice",
    "error-after-opened",
    "support-out-of-range",
    "negative-q",
    "push-junk",
    "huge-numbers",
]


def test_the_cli_finishes_with_the_targets_own_output_whatever_one_hub_sends(
    llama_pair: tuple[Path, Path], expected: dict[str, list[int]], tmp_path: Path
) -> None:
    """Catches a bad proposal ending the CLI (the review: exit 2 with no output, an
    AssertionError, an IndexError in dense_q): each attack against its own target process."""
    runs = {}
    with FakeHub("honest") as probe:  # (keeps the fixtures' models warm in the page cache)
        del probe
    fakes = {name: FakeHub(name).__enter__() for name in CLI_ATTACKS}
    try:
        for name, fake in fakes.items():
            sampled = ("--temperature", "1", "--top-k", "1") if "q" in name else ()
            runs[name] = _cli(fake.endpoint, llama_pair[0], tmp_path, name, *sampled)
        for name, (proc, out) in runs.items():
            assert proc.wait(timeout=180) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
            rows = read_jsonl(out)
            assert [r["prompt"] for r in rows] == PROMPTS, name
            if "q" not in name:  # greedy: token for token the target alone
                for r in rows:
                    assert_greedy(llama_pair[0], r["prompt"], r["token_ids"], expected[r["prompt"]])
            assert fakes[name].stats["opened"] > 0, name
    finally:
        for fake in fakes.values():
            fake.__exit__(None, None, None)


def test_a_sampled_cli_run_beside_a_q_liar_equals_the_target_alone(
    llama_pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """q = -1 (top-k 1, temperature 1): before, the hub's tokens were accepted unconditionally.
    Every proposal is refused now, so the seeded output is the target's alone, token for token."""
    sampled = ("--temperature", "1", "--top-k", "1", "--seed", "7")
    alone = tmp_path / "alone.jsonl"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "edge.target",
            "--standalone",
            "--model",
            str(llama_pair[0]),
            "--prompts",
            str(write_prompts(tmp_path / "a.in.jsonl", PROMPTS)),
            "--out",
            str(alone),
            "--max-new-tokens",
            str(N),
            *sampled,
        ],
        env=ENV,
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=120,
    )
    with FakeHub("negative-q") as fake:
        proc, out = _cli(fake.endpoint, llama_pair[0], tmp_path, "liar", *sampled)
        assert proc.wait(timeout=120) == 0
    assert [r["token_ids"] for r in read_jsonl(out)] == [r["token_ids"] for r in read_jsonl(alone)]


def _serve(hubs: str, target_dir: Path, log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "edge.target",
                "--serve",
                "--port",
                "0",
                "--hub",
                hubs,
                "--model",
                str(target_dir),
                "--deadline-ms",
                "300",
                "--concurrency",
                "4",
                *extra,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=ENV,
            cwd=REPO,
        )
    STARTED.append(proc)
    return proc, wait_for(log, r"serving \S+ on (http://\S+)/v1", proc, timeout=120)


def _complete(url: str, prompt: str) -> httpx.Response:
    body = {"model": "llama-target", "prompt": prompt, "max_tokens": N}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


@pytest.mark.parametrize("attack", ["ping-flood", "oov-tokens"])
def test_serve_beside_a_hostile_hub_answers_every_request_exactly(
    attack: str, llama_pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """``--serve --hub hostile,honest``. ping-flood: a 12 s PING flood aborted the target before
    (libzmq ``_input_stopped``, rc 134, 7-8 s in) and starved its event loop (/health timed
    out); oov-tokens: 6 of 8 requests were HTTP 500. Now every request is 200 with the target
    alone's text, /health answers within a second, and SIGTERM exits 0."""
    from starsd import models

    honest = HubProcess(llama_pair[1], tmp_path / "hub.log")
    target = models.load_causal_lm(llama_pair[0])
    texts = {p: models.decode_ids(target, reference(llama_pair[0], p, N)) for p in PROMPTS}
    with FakeHub(replace(ATTACKS[attack], seconds=12.0)) as fake:
        proc, url = _serve(
            f"{fake.endpoint},{honest.endpoint}", llama_pair[0], tmp_path / "serve.log"
        )
        started, health = time.monotonic(), []
        while time.monotonic() - started < 12.0:
            tick = time.monotonic()
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            health.append(time.monotonic() - tick)
            for prompt in PROMPTS:
                reply = _complete(url, prompt)
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["text"] == texts[prompt]
        assert proc.poll() is None  # alive after the whole attack
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert max(health) < 1.0, health
    assert fake.stats["opened"] > 0 or fake.stats["flooded"] > 10_000
    assert "Traceback" not in (tmp_path / "serve.log").read_text()
    assert honest.stop() == 0
