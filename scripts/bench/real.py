"""The real pair (SmolLM2-135M-Instruct + its draft) side by side in one run, beside the model.

    python -m scripts.bench.real [--quick] [--repeats 2] [--chats 3] [--out results/bench-real.json]

Every mode runs once per repeat, the order rotated by one each repeat (this machine's speed
drifts up to 3x within minutes), over held-out chat prompts, greedy. The one-target modes run
the first ``--chats`` of them (3 by default, to bound a full run; 16, every held-out chat, is
the batched modes' workload too, and the held-out chats differ: the first 3 accept less than
the 16 on average):

* ``standalone``: ``edge.target --standalone`` (the baseline);
* ``hub-auto``, ``hub-g1``, ``hub-g2``: one hub (``--gamma auto``) + one ``edge.target``, the
  sessions on the hub's choice or fixed at gamma 1 / 2 (the target's ``--gamma``);
* ``central-g1/g2/g4``: the in-process centralized loop (the hub's proposer and the target's
  verifier called directly, no sockets), which also measures the costs the model needs: a
  round's drafting and verification seconds and the tokens it commits;
* ``prompt-lookup``: transformers' prompt lookup decoding; ``assisted``: transformers' assisted
  generation with its defaults and the same draft, given the target's vocabulary in this process
  (``scripts.bench.assisted.in_target_vocabulary``): the single-process peers;
* at ``--concurrency`` 4 and 8: ``standalone-cN`` and ``hub-auto-cN`` (the draft LLM), and
  with the EAGLE-3 head ``hub-e3-auto-cN``, ``hub-e3-g1-cN`` and ``hub-e3-g2-cN``: a stream of
  3N chats (at most the 16 held out: 12 at 4, 16 at 8), N at a time (a server's load: a
  request starts as one ends), their rate over the run's wall time. One closed batch of N
  would mostly measure its tail, where the batch thins as sequences end (more so with
  speculation: its sequences end rounds apart), and the model describes full batches;
* with ``models/smollm2-eagle3`` present (``make real-eagle-heads``), a second hub drafting
  with that EAGLE-3 head: ``hub-e3-auto``, ``hub-e3-g1``, ``hub-e3-g2``, and the centralized
  loop with the head, ``central-e3-g1/g2/g4`` (the model's inputs for the head);
* ``standalone-3t`` and ``hub-3t``: three target processes at once (three prompts each), alone
  or through the one hub; their decode rates summed. On this machine the three and the hub
  share two cores, so this measures contention as much as the star: the prediction beside it
  is for targets on hardware of their own.

Each process runs one torch thread: target and hub each take one of the two cores. The
prediction next to each one-target hub mode is the analytic model's under-loaded regime,
tokens per round over the round's time (S(1, g) + the verify, the link left out), from the
costs and the acceptance the centralized loop measured in the same run; for ``--gamma auto``
the best of decoding alone and every measured gamma. The batched modes' predictions come from
T(B), V(B, g) and S(B, g) measured after the repeats (``scripts.bench.real_costs``) and, for the
head, the acceptance its fixed-gamma batched modes measured over their stream: full batches
throughout (``predicted_batched``), and the same costs over the stream the mode ran
(``predicted_stream``: its forwards at the rows still open, the target alone's prefills added
to both sides; ``real_costs.one_target_stream``), which names what the stream's first and last
forwards cost against full batches. The hub's
log (stats every second) gives each hub mode's pre-draft hit and taken rates. Bytes per round
are the encoded PROPOSAL's size, greedy and sampled (top-k 50: q over the support only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scripts.bench import real_costs
from scripts.bench.assisted import hf_assisted, in_target_vocabulary
from scripts.bench.common import BenchConfig, pooled_targets, rotated, target_lines
from scripts.bench.harness import REPO, Processes, start_hub
from scripts.bench.inproc import bench_centralized, bench_standalone
from scripts.train.chat_prompts import HELD_OUT_TOPICS, held_out_prompts
from starsd import models, protocol
from starsd.hub.build import load_proposer
from starsd.hub.config import HubConfig
from starsd.hub.drafters.base import Proposer
from starsd.tree_shapes import TreeShape

TARGET, DRAFT = models.PAIRS["smollm2"]
EAGLE3 = REPO / "models" / "smollm2-eagle3"  # the target's EAGLE-3 head, when it is there
CENTRAL_GAMMAS = (1, 2, 4)
BATCHED_GAMMAS = (1, 2)  # fixed gammas at --concurrency N (the model's best there is 1 or 2)
CONCURRENCIES = (4, 8)
PROMPTS_PER_SLOT = 3  # at --concurrency N: a stream of 3N chats (all 16 held-out ones at 8)
HELD_OUT = len(HELD_OUT_TOPICS)
COST_SIZES = (1, 3, 4, 8)  # B of the batched costs: one target, three, --concurrency 4 and 8
MANY_TARGETS = 3
Mode = Callable[[], dict[str, Any]]
HUB_ARGS = ("--threads", "1", "--stats-interval", "1")
# the token trees measured in process (the hub's --tree on drafts its default, "t2x4n8")
TREE_SHAPES = {
    "t2x3n6": TreeShape(2, 3, 6),
    "t2x4n8": TreeShape(2, 4, 8),
    "t3x4n12": TreeShape(3, 4, 12),
    "t4x5n24": TreeShape(4, 5, 24),
    "t8x4n32": TreeShape(8, 4, 32),  # the protocol's largest tree
}


def chat_rows(count: int, first: int = 0) -> list[dict]:
    """Held-out chat requests as JSONL rows (prompts ``first`` .. ``first + count - 1``)."""
    prompts = held_out_prompts(first + count)[first:]
    if len(prompts) < count:
        raise ValueError(f"{count} chats from {first} asked for; {first + len(prompts)} held out")
    return [
        {"id": first + i, "prompt": m[0]["content"], "messages": m} for i, m in enumerate(prompts)
    ]


def target_cmd(rows: list[dict], work: Path, name: str, tokens: int, concurrency: int) -> list[str]:
    """An ``edge.target`` command line over ``rows`` (written to ``work``), results beside them."""
    prompts = work / f"{name}-in.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "edge.target", "--prompts", str(prompts)]
    cmd += ["--out", str(work / f"{name}-out.jsonl"), "--chat", "--max-new-tokens", str(tokens)]
    return [*cmd, "--concurrency", str(concurrency)]


def target_result(path: Path, wall_s: float | None = None) -> dict:
    """One target run's decode rate, round counts and ids, from its ``--out`` file: tokens
    over ``wall_s`` (a stream of requests), else over the sequences' own decode time (one
    at a time, prefills left out as the centralized loop leaves them out)."""
    results = [json.loads(line) for line in path.read_text().splitlines()]
    generated = sum(len(r["token_ids"]) for r in results)
    decode_s = sum(len(r["token_ids"]) / r["stats"]["tokens_per_s"] for r in results)
    rounds = sum(r["stats"]["rounds"] for r in results)
    return {
        "tokens": generated,
        "tokens_per_s": generated / max(decode_s if wall_s is None else wall_s, 1e-9),
        "rounds": rounds,
        "mean_accepted": sum(r["stats"]["accepted"] for r in results) / max(rounds, 1),
        "alone_steps": sum(r["stats"]["alone_steps"] for r in results),
        "ids": [r["token_ids"] for r in results],
        "lengths": [len(r["token_ids"]) for r in results],  # (kept in the JSON, the ids not)
    }


def run_cli(rows: list[dict], work: Path, tokens: int, concurrency: int, extra: list[str]) -> dict:
    """One ``edge.target`` run over ``rows``; its decode rate and round counts."""
    cmd = [*target_cmd(rows, work, "t", tokens, concurrency), *extra]
    done = subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, text=True, timeout=1200)
    wall_s = run_wall_s(done.stderr) if concurrency > 1 else None
    return target_result(work / "t-out.jsonl", wall_s)


def run_wall_s(log: str) -> float:
    """The seconds of an ``edge.target`` run, from its summary line (``done: ... in X s``)."""
    found = re.search(r"done: \d+ sequences, \d+ tokens in ([0-9.]+) s", log)
    if found is None:
        raise RuntimeError(f"no summary line in the target's log: {log[-500:]!r}")
    return float(found.group(1))


def run_many(groups: Sequence[list[dict]], work: Path, tokens: int, extra: list[str]) -> dict:
    """One ``edge.target`` process per group, all at once: their decode rates summed, their
    ids in group order."""
    names = [f"m{i}" for i in range(len(groups))]
    procs = [
        subprocess.Popen(
            [*target_cmd(rows, work, name, tokens, 1), *extra],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for rows, name in zip(groups, names, strict=True)
    ]
    if any(proc.wait(timeout=1200) for proc in procs):
        raise RuntimeError(f"a target failed: {[proc.returncode for proc in procs]}")
    each = [target_result(work / f"{name}-out.jsonl") for name in names]
    return {
        "tokens": sum(r["tokens"] for r in each),
        "tokens_per_s": sum(r["tokens_per_s"] for r in each),
        "rounds": sum(r["rounds"] for r in each),
        "alone_steps": sum(r["alone_steps"] for r in each),
        "ids": [ids for r in each for ids in r["ids"]],
    }


def with_hub_figures(log: Path, measure: Mode) -> Mode:
    """``measure`` with the hub's pre-draft figures for the targets it served meanwhile."""

    def run() -> dict[str, Any]:
        offset = log.stat().st_size
        result = measure()
        with log.open() as f:
            f.seek(offset)
            lines = target_lines(f.read())
        pooled = pooled_targets(lines, list(lines))
        return {**result, "hit_rate": pooled["hit_rate"], "taken_rate": pooled["taken_rate"]}

    return run


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


def assisted(
    target: models.LoadedModel, draft: models.LoadedModel, prompts: list[list[int]], tokens: int
) -> dict:
    """transformers' assisted generation with its defaults, the draft in the target's vocabulary."""
    out = hf_assisted(target, draft, prompts, tokens)
    return {"tokens_per_s": out["tokens_per_s"], "ids": out["token_ids"]}


def central(
    target: models.LoadedModel,
    proposer: Proposer,
    prompts: list[list[int]],
    tokens: int,
    g: int,
    tree_shape: TreeShape | None = None,
) -> dict:
    """The in-process centralized loop at gamma ``g`` (or drafting trees of ``tree_shape``):
    its rate and per-round costs."""
    cfg = BenchConfig("real", str(TARGET), str(DRAFT), gamma=g, max_new_tokens=tokens)
    record, measured = bench_centralized(target, proposer, cfg, prompts, tree_shape)
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
    """Speedups the analytic model predicts for one target, from the centralized costs: per
    drafter (the draft LLM's keys ``g1``.., the EAGLE-3 head's ``e3-g1``..) and its auto."""
    pred = {}
    for drafter in ("", "e3-"):
        if f"central-{drafter}g{CENTRAL_GAMMAS[0]}" not in runs:
            continue
        for g in CENTRAL_GAMMAS:
            c = runs[f"central-{drafter}g{g}"]
            rate = (1 + c["mean_accepted"]) * step_s / (c["draft_s"] + c["verify_s"])
            pred[f"{drafter}g{g}"] = rate
        each = [pred[f"{drafter}g{g}"] for g in CENTRAL_GAMMAS]
        pred[f"{drafter}auto"] = max(1.0, *each)
    for name in TREE_SHAPES:
        c = runs.get(f"central-e3-{name}")
        if c is not None:
            pred[f"e3-{name}"] = (1 + c["mean_accepted"]) * step_s / (c["draft_s"] + c["verify_s"])
    if "e3-auto" in pred and "e3-t2x4n8" in pred:  # the hub's --tree on shape; chains' best
        pred["e3-trees"], pred["e3-chains"] = pred["e3-t2x4n8"], pred["e3-auto"]
    return pred


def tokens_per_round(runs: dict[str, dict]) -> dict[str, Any]:
    """Committed tokens per round (accepted + 1) of the EAGLE-3 head's chains and trees in
    process, and the best tree's over the best chain's."""
    per = {
        name.removeprefix("central-e3-"): 1 + r["mean_accepted"]
        for name, r in runs.items()
        if name.startswith("central-e3-")
    }
    trees = [v for k, v in per.items() if k in TREE_SHAPES]
    chains = [v for k, v in per.items() if k not in TREE_SHAPES]
    ratio = max(trees) / max(chains) if trees and chains else float("nan")
    return {"per_shape": per, "best_tree_over_best_chain": ratio}


def batched_predictions(runs: dict[str, dict], costs: dict[str, Any]) -> dict[str, dict]:
    """The model at --concurrency N (one target batching N sequences) and for N targets."""
    accepted = {g: runs[f"central-g{g}"]["mean_accepted"] for g in CENTRAL_GAMMAS}
    out = {f"c{n}": real_costs.one_target_batched(costs, accepted, n) for n in CONCURRENCIES}
    out[f"{MANY_TARGETS}t"] = real_costs.many_targets(costs, accepted, MANY_TARGETS)
    if "draft_ms_e3" in costs and "central-e3-g1" in runs:  # the EAGLE-3 head's S(B, g)
        head_costs = {**costs, "draft_ms": costs["draft_ms_e3"]}
        for n in CONCURRENCIES:
            head = batched_acceptance(runs, n)
            out[f"e3-c{n}"] = real_costs.one_target_batched(head_costs, head, n)
    return out


def stream_predictions(runs: dict[str, dict], costs: dict[str, Any]) -> dict[str, dict]:
    """The model at --concurrency N over the stream each batched mode ran (its requests'
    lengths and the target alone's time from the baseline run): ``real_costs.one_target_stream``
    per drafter, beside the full-batch figures of :func:`batched_predictions`."""
    out = {}
    for n in CONCURRENCIES:
        base = runs.get(f"standalone-c{n}", {})
        if "lengths" not in base:
            continue
        alone_s = base["tokens"] / base["tokens_per_s"]
        accepted = {g: runs[f"central-g{g}"]["mean_accepted"] for g in CENTRAL_GAMMAS}
        stream = (costs, accepted, n, base["lengths"], alone_s)
        out[f"c{n}"] = real_costs.one_target_stream(*stream)
        if "draft_ms_e3" in costs and "central-e3-g1" in runs:
            head = {**costs, "draft_ms": costs["draft_ms_e3"]}
            stream = (head, batched_acceptance(runs, n), n, base["lengths"], alone_s)
            out[f"e3-c{n}"] = real_costs.one_target_stream(*stream)
    return out


def batched_acceptance(runs: dict[str, dict], n: int) -> dict[int, float]:
    """The EAGLE-3 head's accepted drafts a round per gamma at ``--concurrency n``: the fixed-gamma
    mode's own where the run has it, else the centralized loop's. Why: the batched modes run
    every held-out chat, the centralized loop only the one-target modes' chats (3 by default),
    which accept less (0.60 against 0.70 at gamma 2): the model priced another workload."""
    own = (runs.get(f"hub-e3-g{g}-c{n}") for g in CENTRAL_GAMMAS)
    return {
        g: (mode or runs[f"central-e3-g{g}"])["mean_accepted"]
        for g, mode in zip(CENTRAL_GAMMAS, own, strict=True)
    }


class Bench:
    """What every mode needs: the models in this process, the hub's endpoint and log, a
    scratch directory."""

    def __init__(self, hubs: dict[str, tuple[str, Path]], work: Path, tokens: int) -> None:
        torch.set_num_threads(1)
        self.target = models.load_causal_lm(TARGET)
        self.draft = models.load_causal_lm(DRAFT)
        in_target_vocabulary(self.draft, str(DRAFT))
        self.proposer, _ = load_proposer(HubConfig(model=str(DRAFT), threads=1))
        self.eagle3: Proposer | None = None
        if "e3" in hubs:
            config = HubConfig(model=str(EAGLE3), draft_kind="eagle3", target=str(TARGET))
            self.eagle3, _ = load_proposer(dataclasses.replace(config, threads=1))
        self.hubs, self.work, self.tokens = hubs, work, tokens  # drafter -> (endpoint, log)
        self.endpoint, self.log = hubs["llm"]

    def prompts(self, rows: list[dict]) -> list[list[int]]:
        return [models.chat_prompt_ids(self.target, r["messages"]) for r in rows]

    def cli(self, rows: list[dict], concurrency: int, *extra: str) -> Mode:
        return lambda: run_cli(rows, self.work, self.tokens, concurrency, list(extra))

    def hub(self, rows: list[dict], concurrency: int, *extra: str, drafter: str = "llm") -> Mode:
        endpoint, log = self.hubs[drafter]
        mode = self.cli(rows, concurrency, "--hub", endpoint, *extra)
        return with_hub_figures(log, mode)


def plan(b: Bench, quick: bool, chats: int) -> dict[str, Mode]:
    """Every mode of one repeat, by name; the one-target modes over ``chats`` held-out chats."""
    rows = chat_rows(chats)
    prompts = b.prompts(rows)
    modes: dict[str, Mode] = {
        "standalone": b.cli(rows, 1, "--standalone"),
        "hub-auto": b.hub(rows, 1),
        "hub-g1": b.hub(rows, 1, "--gamma", "1"),
        "hub-g2": b.hub(rows, 1, "--gamma", "2"),
        "prompt-lookup": lambda: prompt_lookup(b.target, prompts, b.tokens),
        "assisted": lambda: assisted(b.target, b.draft, prompts, b.tokens),
        "standalone-inproc": lambda: standalone_in_process(b.target, prompts, b.tokens),
    }
    for g in CENTRAL_GAMMAS:
        modes[f"central-g{g}"] = lambda g=g: central(b.target, b.proposer, prompts, b.tokens, g)
    if b.eagle3 is not None:
        modes |= eagle3_modes(b, rows, prompts, b.eagle3)
    if quick:
        return modes
    for n in CONCURRENCIES:
        stream = chat_rows(min(PROMPTS_PER_SLOT * n, HELD_OUT))
        modes[f"standalone-c{n}"] = b.cli(stream, n, "--standalone")
        modes[f"hub-auto-c{n}"] = b.hub(stream, n)
        if b.eagle3 is not None:
            modes[f"hub-e3-auto-c{n}"] = b.hub(stream, n, drafter="e3")
            for g in BATCHED_GAMMAS:  # the fixed gammas auto is judged against
                modes[f"hub-e3-g{g}-c{n}"] = b.hub(stream, n, "--gamma", str(g), drafter="e3")
    groups = [chat_rows(3, 3 * i) for i in range(MANY_TARGETS)]
    modes[f"standalone-{MANY_TARGETS}t"] = lambda: run_many(
        groups, b.work, b.tokens, ["--standalone"]
    )
    many_hub = lambda: run_many(groups, b.work, b.tokens, ["--hub", b.endpoint])  # noqa: E731
    modes[f"hub-{MANY_TARGETS}t"] = with_hub_figures(b.log, many_hub)
    return modes


# What every result needs whatever ``--modes`` asks for: the baseline, and the centralized
# loop's costs and acceptance that the model's predictions are made from.
MODEL_INPUTS = ("standalone", "standalone-inproc")
MODEL_INPUT_PREFIX = "central-"
TREE_MODE_PREFIXES = ("hub-e3-trees", "hub-e3-chains", "central-e3-t")


def selected(modes: dict[str, Mode], prefixes: Sequence[str]) -> dict[str, Mode]:
    """The modes whose names start with one of ``prefixes``, their baselines, and the model's
    inputs (:data:`MODEL_INPUTS`, the centralized chains; the centralized trees only when a
    tree mode is asked for); every mode when ``prefixes`` is empty."""
    if not prefixes:
        return modes
    asked = [m for m in modes if m.startswith(tuple(prefixes))]
    baselines = paired_baselines(False)
    wanted = {*MODEL_INPUTS, *asked, *(baselines[m] for m in asked if m in baselines)}
    trees = any(m.startswith(TREE_MODE_PREFIXES) for m in asked)
    inputs = {m for m in modes if m.startswith(MODEL_INPUT_PREFIX) and (trees or not is_tree(m))}
    return {m: f for m, f in modes.items() if m in wanted | inputs}


def is_tree(mode: str) -> bool:
    """Whether ``mode`` is a centralized run of a token tree."""
    return mode.removeprefix("central-e3-") in TREE_SHAPES


def eagle3_modes(
    b: Bench, rows: list[dict], prompts: list[list[int]], head: Proposer
) -> dict[str, Mode]:
    """The same target through an EAGLE-3 hub (auto, gamma 1, 2) and the centralized loop with
    the head (its acceptance and costs, for the model)."""
    modes = {"hub-e3-auto": b.hub(rows, 1, drafter="e3")}
    for g in (1, 2):
        modes[f"hub-e3-g{g}"] = b.hub(rows, 1, "--gamma", str(g), drafter="e3")
    for g in CENTRAL_GAMMAS:
        modes[f"central-e3-g{g}"] = lambda g=g: central(b.target, head, prompts, b.tokens, g)
    # token trees: the hub with trees always, with chains only, and the trees' own costs
    modes["hub-e3-trees"] = b.hub(rows, 1, drafter="e3-trees")
    modes["hub-e3-chains"] = b.hub(rows, 1, drafter="e3-chains")
    for name, shape in TREE_SHAPES.items():
        modes[f"central-e3-{name}"] = lambda shape=shape: central(
            b.target, head, prompts, b.tokens, 1, shape
        )
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
    """Per mode: the median of every numeric figure over the repeats, the first run's ids and
    lengths (greedy: every repeat's alike)."""
    out = {}
    for name, reps in runs.items():
        keys = [k for k, v in reps[0].items() if isinstance(v, int | float)]
        out[name] = {k: statistics.median(rep[k] for rep in reps) for k in keys}
        out[name] |= {k: reps[0][k] for k in ("ids", "lengths") if k in reps[0]}
    return out


# Each batched mode and its baseline: the same prompts at the same concurrency, alone.
def paired_baselines(quick: bool) -> dict[str, str]:
    if quick:
        return {}
    pairs = {
        f"{mode}-c{n}": f"standalone-c{n}"
        for n in CONCURRENCIES
        for mode in ("hub-auto", "hub-e3-auto", *(f"hub-e3-g{g}" for g in BATCHED_GAMMAS))
    }
    return pairs | {f"hub-{MANY_TARGETS}t": f"standalone-{MANY_TARGETS}t"}


def summarise(runs: dict[str, dict], quick: bool) -> dict[str, Any]:
    """Ratios to the baselines, the model's predictions and the token-for-token checks."""
    base = runs["standalone"]["tokens_per_s"]
    pairs = {m: b for m, b in paired_baselines(quick).items() if m in runs and b in runs}
    ratios = {  # each mode over the target alone at its concurrency (the baselines left out)
        name: r["tokens_per_s"] / base
        for name, r in runs.items()
        if not name.startswith("standalone") or name == "standalone-inproc"
    }
    for mode, baseline in pairs.items():
        ratios[mode] = runs[mode]["tokens_per_s"] / runs[baseline]["tokens_per_s"]
    one = [n for n in runs if "ids" in runs[n] and n not in pairs and n not in pairs.values()]
    identical = all(runs[name]["ids"] == runs["standalone"]["ids"] for name in one)
    identical &= all(runs[m]["ids"] == runs[b]["ids"] for m, b in pairs.items())
    pred = predictions(runs, runs["standalone-inproc"]["step_s"])
    return {
        "ratios": ratios,
        "predicted": pred,
        "identical": identical,
        "tokens_per_round": tokens_per_round(runs),
    }


def predicted_for(result: dict[str, Any], mode: str, stream: bool = False) -> float:
    """The model's speedup beside ``mode`` (NaN where it has none); ``stream``: at
    --concurrency N, over the stream the mode ran (``predicted_stream``) instead of full
    batches throughout."""
    pred, batched = result["predicted"], result.get("predicted_batched", {})
    if stream:
        pred, batched = {}, result.get("predicted_stream", {})
    key = mode.removeprefix("hub-").removeprefix("central-")
    if key in pred:
        return pred[key]
    batched_modes = re.fullmatch(r"hub-(e3-)?(auto|g\d+)-(c\d+)", mode)
    if batched_modes:
        drafter, gamma, concurrency = batched_modes.groups()
        return batched.get((drafter or "") + concurrency, {}).get(gamma, float("nan"))
    if mode.startswith("hub-") and mode.endswith("t"):
        return batched.get(mode.removeprefix("hub-"), {}).get("auto", float("nan"))
    return float("nan")


def plot(result: dict[str, Any], path: Path) -> None:
    """Measured speedup over the target alone per mode, the model's prediction beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in result["ratios"] if n != "standalone-inproc"]
    fig, ax = plt.subplots(figsize=(10, 4))
    x = np.arange(len(names))
    ax.bar(x - 0.27, [result["ratios"][n] for n in names], 0.27, label="measured")
    ax.bar(x, [predicted_for(result, n) for n in names], 0.27, label="analytic model")
    streams = [predicted_for(result, n, stream=True) for n in names]
    ax.bar(x + 0.27, streams, 0.27, label="the model over the stream run (-cN)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(x, names, rotation=30, ha="right")
    ax.set_ylabel("x the target alone (-cN, -3t: at the same load)")
    ax.set_title("SmolLM2-135M-Instruct + its draft, greedy chat, this 2-core CPU")
    ax.set_ylim(0, 1.3 * max([1.0, *(b.get_height() for b in ax.patches if b.get_height() > 0)]))
    ax.legend(loc="upper left", ncol=3)  # (above the bars: the headroom of set_ylim)
    fig.tight_layout()
    fig.savefig(path)


def run(args: argparse.Namespace, procs: Processes, work: Path) -> dict[str, Any]:
    """The hub, every mode's repeats, then the batched costs; the result as written."""
    tokens, repeats = (32, 1) if args.quick else (args.max_new_tokens, args.repeats)
    log = work / "hub.log"
    hubs = {"llm": (start_hub(procs, str(DRAFT), log, *HUB_ARGS)[1], log)}
    if EAGLE3.is_dir():  # the EAGLE-3 hub beside the draft LLM's
        e3_log, e3_args = work / "hub-e3.log", ["--draft-kind", "eagle3", "--target", str(TARGET)]
        hubs["e3"] = (start_hub(procs, str(EAGLE3), e3_log, *HUB_ARGS, *e3_args)[1], e3_log)
        for tree_mode, name in (("on", "e3-trees"), ("off", "e3-chains")):
            log_t, args_t = work / f"hub-{name}.log", [*e3_args, "--tree", tree_mode]
            hubs[name] = (start_hub(procs, str(EAGLE3), log_t, *HUB_ARGS, *args_t)[1], log_t)
    chats = 2 if args.quick else args.chats  # the one-target modes' held-out chats
    bench = Bench(hubs, work, tokens)
    asked = args.modes.split(",") if args.modes else []
    modes = selected(plan(bench, args.quick, chats), asked)
    runs = medians(run_repeats(modes, repeats))
    result = {"max_new_tokens": tokens, "repeats": repeats, "chats": chats}
    result |= summarise(runs, args.quick)
    sizes, cost_repeats = ((1,), 2) if args.quick else (COST_SIZES, 6)
    costs = real_costs.measure(bench.target, bench.proposer, sizes, CENTRAL_GAMMAS, cost_repeats)
    if bench.eagle3 is not None:
        costs["draft_ms_e3"] = real_costs.draft_ms(
            bench.eagle3, bench.target, sizes, CENTRAL_GAMMAS, cost_repeats
        )
    if not args.quick:
        result["predicted_batched"] = batched_predictions(runs, costs)
        result["predicted_stream"] = stream_predictions(runs, costs)
    result["costs"] = costs
    result["proposal_bytes"] = {
        g: proposal_bytes(g, bench.target.vocab_size, 50) for g in (1, 2, 4)
    }
    result["runs"] = {k: {f: v for f, v in r.items() if f != "ids"} for k, r in runs.items()}
    return result


def main(argv: list[str] | None = None) -> None:
    """Run every mode, print the summary, write the JSON."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--chats",
        type=_chats,
        default=3,
        help=f"held-out chats of the one-target modes (1..{HELD_OUT}; default 3)",
    )
    p.add_argument(
        "--modes",
        default="",
        help="comma-separated mode-name prefixes to run (e.g. hub-auto-c); their baselines and "
        "the model's inputs always run; default: every mode",
    )
    p.add_argument("--out", type=Path, default=REPO / "results" / "bench-real.json")
    args = p.parse_args(argv)
    procs = Processes()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            result = run(args, procs, Path(tmp))
    finally:
        procs.stop_all()
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    keys = ("ratios", "predicted", "predicted_batched", "predicted_stream", "identical")
    keys += ("tokens_per_round",)
    print(json.dumps({k: result[k] for k in keys if k in result}, indent=2))


def _chats(text: str) -> int:
    """argparse type of --chats: 1 .. the held-out chats."""
    count = int(text)
    if not 1 <= count <= HELD_OUT:
        raise argparse.ArgumentTypeError(f"--chats takes 1..{HELD_OUT}, got {count}")
    return count


if __name__ == "__main__":
    main()
