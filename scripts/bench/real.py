"""The real pair (SmolLM2-135M-Instruct + its draft) side by side in one run, beside the model.

    python -m scripts.bench.real [--quick] [--repeats 2] [--out results/bench-real.json]

Every mode runs once per repeat, the order rotated by one each repeat (this machine's speed
drifts up to 3x within minutes), over held-out chat prompts, greedy:

* ``standalone``: ``edge.target --standalone`` (the baseline);
* ``hub-auto``, ``hub-g1``, ``hub-g2``: one hub (``--gamma auto``) + one ``edge.target``, the
  sessions on the hub's choice or fixed at gamma 1 / 2 (the target's ``--gamma``);
* ``central-g1/g2/g4``: the in-process centralized loop (the hub's proposer and the target's
  verifier called directly, no sockets), which also measures the costs the model needs: a
  round's drafting and verification seconds and the tokens it commits;
* ``prompt-lookup``: transformers' prompt lookup decoding, the single-process peer this draft
  allows (assisted generation needs the draft to predict over the target's whole vocabulary);
* at ``--concurrency`` 4 and 8: ``standalone-cN`` and ``hub-auto-cN``.

Each process runs one torch thread: target and hub each take one of the two cores. The
prediction next to each hub mode is the analytic model's under-loaded regime for one target,
tokens per round over the round's time (S(1, g) + the verify, the link left out), from the
costs and the acceptance the centralized loop measured in the same run; for ``--gamma auto``
the best of decoding alone and every measured gamma. Bytes per round are the encoded
PROPOSAL's size, greedy and sampled (top-k 50: q over the support only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scripts.bench.common import BenchConfig, rotated
from scripts.bench.harness import REPO
from scripts.bench.run import bench_centralized, bench_standalone
from scripts.train.chat_prompts import held_out_prompts
from starsd import models, protocol
from starsd.hub.build import load_proposer
from starsd.hub.config import HubConfig

TARGET, DRAFT = models.PAIRS["smollm2"]
ENDPOINT = "tcp://127.0.0.1:5791"
CENTRAL_GAMMAS = (1, 2, 4)
Mode = Callable[[], dict[str, Any]]


def chat_rows(count: int) -> list[dict]:
    """Held-out chat requests as JSONL rows (ids 0..count-1)."""
    return [
        {"id": i, "prompt": m[0]["content"], "messages": m}
        for i, m in enumerate(held_out_prompts(count))
    ]


def run_cli(rows: list[dict], work: Path, tokens: int, concurrency: int, extra: list[str]) -> dict:
    """One ``edge.target`` run over ``rows``; its decode rate and round counts."""
    prompts, out = work / "in.jsonl", work / "out.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "edge.target", "--prompts", str(prompts), "--out", str(out)]
    cmd += ["--chat", "--max-new-tokens", str(tokens), "--concurrency", str(concurrency), *extra]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, timeout=1200)
    results = [json.loads(line) for line in out.read_text().splitlines()]
    generated = sum(len(r["token_ids"]) for r in results)
    decode_s = sum(len(r["token_ids"]) / r["stats"]["tokens_per_s"] for r in results)
    rounds = sum(r["stats"]["rounds"] for r in results)
    return {
        "tokens": generated,
        "tokens_per_s": generated / max(decode_s / concurrency, 1e-9),
        "rounds": rounds,
        "mean_accepted": sum(r["stats"]["accepted"] for r in results) / max(rounds, 1),
        "alone_steps": sum(r["stats"]["alone_steps"] for r in results),
        "ids": [r["token_ids"] for r in results],
    }


def prompt_lookup(target: models.LoadedModel, prompts: list[list[int]], tokens: int) -> dict:
    """transformers' prompt lookup decoding, one request at a time."""
    generated, seconds, ids = 0, 0.0, []
    for prompt in prompts:
        began = time.perf_counter()
        out = target.model.generate(
            torch.tensor([prompt]),
            max_new_tokens=tokens,
            do_sample=False,
            prompt_lookup_num_tokens=4,
        )
        seconds += time.perf_counter() - began
        ids.append(out[0, len(prompt) :].tolist())
        generated += len(ids[-1])
    return {"tokens": generated, "tokens_per_s": generated / seconds, "ids": ids}


def central(target: models.LoadedModel, prompts: list[list[int]], tokens: int, g: int) -> dict:
    """The in-process centralized loop at gamma ``g``: its rate and per-round costs."""
    cfg = BenchConfig("real", str(TARGET), str(DRAFT), gamma=g, max_new_tokens=tokens)
    proposer, _ = load_proposer(HubConfig(model=str(DRAFT), threads=1))
    record, measured = bench_centralized(target, proposer, cfg, prompts)
    return {"tokens_per_s": record["system_tokens_per_s"], **measured}


def standalone_in_process(
    target: models.LoadedModel, prompts: list[list[int]], tokens: int
) -> dict:
    """The target's own run path in this process: the decode step T_ar beside the loop's."""
    cfg = BenchConfig("real", str(TARGET), str(DRAFT), max_new_tokens=tokens)
    record, step_s, _ = bench_standalone(target, cfg, prompts)
    return {"tokens_per_s": record["system_tokens_per_s"], "step_s": step_s}


def proposal_bytes(gamma: int, vocab: int, top_k: int) -> dict[str, int]:
    """Encoded PROPOSAL sizes with ``gamma`` tokens: greedy, top-k sampled, dense q."""
    tokens = np.zeros(gamma, np.int32)

    def size(**q: Any) -> int:
        msg = protocol.Proposal(b"t" * 16, 1, tokens, **q)
        return sum(len(f) for f in protocol.encode(msg))

    sparse = np.zeros((gamma, top_k), np.float32), np.zeros((gamma, top_k), np.int32)
    return {
        "greedy": size(),
        "top_k": size(q_probs=sparse[0], q_support=sparse[1]),
        "dense": size(q_probs=np.zeros((gamma, vocab), np.float32)),
    }


def predictions(runs: dict[str, dict], step_s: float) -> dict[str, float]:
    """Speedups the analytic model predicts for one target, from the centralized costs."""
    pred = {}
    for g in CENTRAL_GAMMAS:
        c = runs[f"central-g{g}"]
        pred[f"g{g}"] = (1 + c["mean_accepted"]) * step_s / (c["draft_s"] + c["verify_s"])
    pred["auto"] = max(1.0, *pred.values())
    return pred


def plan(target: models.LoadedModel, work: Path, quick: bool, tokens: int) -> dict[str, Mode]:
    """Every mode of one repeat, by name."""
    rows = chat_rows(2 if quick else 3)
    prompts = [models.chat_prompt_ids(target, r["messages"]) for r in rows]
    hub = ["--hub", ENDPOINT]
    modes: dict[str, Mode] = {
        "standalone": lambda: run_cli(rows, work, tokens, 1, ["--standalone"]),
        "hub-auto": lambda: run_cli(rows, work, tokens, 1, hub),
        "hub-g1": lambda: run_cli(rows, work, tokens, 1, [*hub, "--gamma", "1"]),
        "hub-g2": lambda: run_cli(rows, work, tokens, 1, [*hub, "--gamma", "2"]),
        "prompt-lookup": lambda: prompt_lookup(target, prompts, tokens),
        "standalone-inproc": lambda: standalone_in_process(target, prompts, tokens),
    }
    for g in CENTRAL_GAMMAS:
        modes[f"central-g{g}"] = lambda g=g: central(target, prompts, tokens, g)
    for n in () if quick else (4, 8):
        many = chat_rows(n)
        modes[f"standalone-c{n}"] = lambda m=many, n=n: run_cli(
            m, work, tokens, n, ["--standalone"]
        )
        modes[f"hub-auto-c{n}"] = lambda m=many, n=n: run_cli(m, work, tokens, n, hub)
    return modes


def run_repeats(modes: dict[str, Mode], repeats: int) -> dict[str, list[dict]]:
    """Each mode ``repeats`` times, the order rotated per repeat; progress on stdout."""
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for r in range(repeats):
        for name in rotated(list(modes), r):
            began = time.perf_counter()
            runs[name].append(modes[name]())
            rate = runs[name][-1]["tokens_per_s"]
            took = time.perf_counter() - began
            print(f"[{r + 1}/{repeats}] {name}: {rate:.1f} tok/s ({took:.0f} s)", flush=True)
    return runs


def medians(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per mode: the median of every numeric figure over the repeats, the first run's ids."""
    out = {}
    for name, reps in runs.items():
        keys = [k for k, v in reps[0].items() if isinstance(v, int | float)]
        out[name] = {k: statistics.median(rep[k] for rep in reps) for k in keys}
        if "ids" in reps[0]:
            out[name]["ids"] = reps[0]["ids"]
    return out


def summarise(runs: dict[str, dict], quick: bool) -> dict[str, Any]:
    """Ratios to the baselines, the model's predictions and the token-for-token checks."""
    base = runs["standalone"]["tokens_per_s"]
    pred = predictions(runs, runs["standalone-inproc"]["step_s"])
    ratios = {  # each mode over the target alone at its concurrency (the baselines left out)
        name: r["tokens_per_s"] / base
        for name, r in runs.items()
        if not name.startswith("standalone") or name == "standalone-inproc"
    }
    for n in () if quick else (4, 8):
        ratios[f"hub-auto-c{n}"] = (
            runs[f"hub-auto-c{n}"]["tokens_per_s"] / runs[f"standalone-c{n}"]["tokens_per_s"]
        )
    one = [name for name in runs if "ids" in runs[name] and not name.endswith(("-c4", "-c8"))]
    identical = all(runs[name]["ids"] == runs["standalone"]["ids"] for name in one)
    for n in () if quick else (4, 8):
        identical &= runs[f"hub-auto-c{n}"]["ids"] == runs[f"standalone-c{n}"]["ids"]
    return {"ratios": ratios, "predicted": pred, "identical": identical}


def plot(result: dict[str, Any], path: Path) -> None:
    """Measured speedup over the target alone per mode, the model's prediction beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in result["ratios"] if n != "standalone-inproc"]
    key = {f"hub-g{g}": f"g{g}" for g in CENTRAL_GAMMAS} | {"hub-auto": "auto"}
    key |= {f"central-g{g}": f"g{g}" for g in CENTRAL_GAMMAS}
    predicted = [result["predicted"].get(key.get(n, ""), float("nan")) for n in names]
    fig, ax = plt.subplots(figsize=(9, 4))
    x = np.arange(len(names))
    ax.bar(x - 0.2, [result["ratios"][n] for n in names], 0.4, label="measured")
    ax.bar(x + 0.2, predicted, 0.4, label="analytic model")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(x, names, rotation=30, ha="right")
    ax.set_ylabel("x the target alone (-cN: at --concurrency N)")
    ax.set_title("SmolLM2-135M-Instruct + its draft, greedy chat, this 2-core CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    """Run every mode, print the summary, write the JSON."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=REPO / "results" / "bench-real.json")
    args = p.parse_args(argv)
    tokens, repeats = (32, 1) if args.quick else (args.max_new_tokens, args.repeats)
    torch.set_num_threads(1)
    target = models.load_causal_lm(TARGET)
    hub_cmd = [sys.executable, "-m", "starsd.hub", "--bind", ENDPOINT, "--threads", "1"]
    hub = subprocess.Popen(hub_cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(8)  # the hub loads its draft
        with tempfile.TemporaryDirectory() as tmp:
            runs = medians(run_repeats(plan(target, Path(tmp), args.quick, tokens), repeats))
    finally:
        hub.terminate()
        hub.wait(timeout=30)
    result = {"max_new_tokens": tokens, "repeats": repeats, **summarise(runs, args.quick)}
    result["proposal_bytes"] = {g: proposal_bytes(g, target.vocab_size, 50) for g in (1, 2, 4)}
    result["runs"] = {k: {f: v for f, v in r.items() if f != "ids"} for k, r in runs.items()}
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("ratios", "predicted", "identical")}, indent=2))


if __name__ == "__main__":
    main()
