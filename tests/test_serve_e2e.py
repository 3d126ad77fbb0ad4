"""``python -m starsd.hub --metrics-port`` and ``python -m edge.target --serve`` as real
processes: greedy text over HTTP equals the target alone, both /metrics scrape and parse, and
SIGTERM stops the server cleanly with its summary line."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from procs import ENV, REPO, STARTED, HubProcess, reference, wait_for
from prometheus_client.parser import text_string_to_metric_families

from starsd import models

pytestmark = pytest.mark.slow


def _scrape(url: str) -> dict[str, float]:
    text = httpx.get(url, timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_serve_process_with_a_hub_process_and_both_metrics_endpoints(
    llama_pair: tuple[Path, Path], llama_target: models.LoadedModel, tmp_path: Path
) -> None:
    """Bugs caught: --serve or --metrics-port broken outside the test harness (argument
    plumbing, logging config, the uvicorn loop under uvloop), a hang or traceback on SIGTERM."""
    hub = HubProcess(llama_pair[1], tmp_path / "hub.log", "--metrics-port", "0")
    hub_metrics = wait_for(hub.log_path, r"metrics on (http://\S+)", hub.proc)
    log = tmp_path / "serve.log"
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
                hub.endpoint,
                "--model",
                str(llama_pair[0]),
                "--deadline-ms",
                "5000",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=ENV,
            cwd=REPO,
        )
    STARTED.append(proc)
    url = wait_for(log, r"serving \S+ on (http://\S+)/v1", proc, timeout=120)
    prompt = "To be, or not to be"
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": "llama-target", "prompt": prompt, "max_tokens": 20},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == models.decode_ids(
        llama_target, reference(llama_pair[0], prompt, 20)
    )
    accepted = r.json()["starsd"]["accepted"]
    target = _scrape(f"{url}/metrics")
    assert target["starsd:spec_decode_num_accepted_tokens_total"] == accepted
    assert target["starsd:hub_connected"] == 1
    assert _scrape(hub_metrics)["starsd:hub_jobs_total"] > 0
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    text = log.read_text()
    assert "stopped after" in text and "1 requests" in text and "Traceback" not in text, text
    assert hub.stop() == 0
