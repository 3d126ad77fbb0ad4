"""The main suite's pre-drafting figures: hit rate and queue wait with and without pre-drafting,
N = 1, 2, 4 real target processes, greedy and sampled (run by ``python -m scripts.bench.run
--suite main``).

Two hubs on the committed pair, both with ``--gamma auto`` (the default), started once: one with
its default pre-drafting, one with ``--predraft-branches 0``. As in the scale suite, the hubs run
on the first CPU (the draft device) and the targets on the others: unpinned, pre-drafting's
forwards took the core that the targets' and the hubs' event loops and I/O threads otherwise
found idle while a target verified, which on 2 shared cores cost more than any hit could save
(a deployment's hub has hardware of its own). For every case (N, temperature)
the same N ``edge.target`` processes (gamma 0: the hub's choice) run the prompt set against
each hub, back to back, twice (QUICK: once), which hub goes first alternating from case to case
and from one repetition to the next (A B B A); medians per case. From each hub's
log (``--stats-interval`` 0.5 s, so that a stats line follows every target's last job while it
is still listed): each target's hit rate (``predraft_hits``: jobs answered from a pre-drafted
branch) and mean queue wait (``queue_wait_ms``: a job's time in Q_in before its batch starts,
which includes the rest of a pre-draft step in progress when it arrived), pooled over the
case's targets by rounds; the hub's time spent pre-drafting (``predraft_s``). STATS carries
neither the hits nor a per-target wait, hence the log.

"A pre-draft step never delays a waiting job by more than one small step": the queue wait with
pre-drafting minus without it, against one pre-draft step of the same hub's draft, timed in
this process (a :class:`starsd.hub.predraft.Predrafter` over N fake sessions, every step from
the first probe to the last branch; median and largest). With real targets the two hubs'
waits also differ for other reasons once N > 1 (pre-drafting changes the gammas chosen and the
batches formed, and on 2 cores its forwards compete with the targets' for the CPU), so the
same check also runs with emulated targets (``scripts/emulate/emulated.py``, gamma 4, verify 16 ms +
1.5 ms per token, a sleep: no CPU of their own, and random tokens, so no branch ever hits and
pre-drafting runs in every idle moment: the worst case for the delay): the hub's mean queue wait
and the rounds' proposal wait (p50/p99) with and without.

The analytic model (``ModelInputs.hit_rate``, ``taken_rate``) beside each case where it applies:
the case's own acceptance and mean gamma, with the measured hit and taken rates and without.
The targets run with their defaults, so with pushed branches (``--push 4``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from scripts.bench.common import (
    STATS_INTERVAL_S,
    BenchConfig,
    connected_targets,
    hub_line,
    pooled_targets,
    target_lines,
)
from scripts.bench.harness import Processes, start_hub_set, stop
from scripts.bench.pinning import pinned
from starsd import analytic, models

NS = (1, 2, 4)
TEMPERATURES = (0.0, 0.8)
WITH, WITHOUT = "predraft", "no-predraft"
HUB_ARGS = {WITH: [], WITHOUT: ["--predraft-branches", "0"]}
STEP_REPEATS, QUICK_STEP_REPEATS = 6, 3
REPS, QUICK_REPS = 2, 1  # per case and hub: A B B A (QUICK: A B, the next case B A)
# STATS sums queue waits over the targets connected now, so a target of an earlier run that the
# hub forgets (3 heartbeats after its last message) inside a window takes its waits out of the
# sum: the emulator's queue wait for that window reads low, even negative. Wait them out.
LEASE_WAIT_S = 4.0
PROMPT_TOKENS = 64

# (endpoints, tag, extra target arguments) -> each target's JSONL rows
RunTargets = Callable[[list[str], str, Sequence[str]], list[list[dict]]]
# (endpoint, N, tag, extra emulator arguments) -> the emulator's report
Emulate = Callable[[str, int, str, Sequence[str]], dict]


def cases(
    ns: Sequence[int] = NS, temperatures: Sequence[float] = TEMPERATURES, reps: int = 1
) -> list[tuple[int, float, tuple[str, str]]]:
    """(N, temperature, hub order) per case, ``reps`` times in a row; the hub that goes first
    alternates from case to case and from one repetition to the next."""
    out = []
    for i, (t, n) in enumerate((t, n) for t in temperatures for n in ns):
        for r in range(reps):
            out.append((n, t, (WITH, WITHOUT) if (i + r) % 2 == 0 else (WITHOUT, WITH)))
    return out


def predraft_steps(
    draft: models.LoadedModel,
    n_sessions: int,
    gamma: int,
    repeats: int,
    branches: int = 4,
    rows: int = 32,
) -> list[float]:
    """Seconds per pre-draft step for ``n_sessions`` sessions, as the hub's drafting thread runs
    them between jobs: each round, every session is offered and steps run until none is left."""
    from scripts.bench.service import FakeSessions
    from starsd.hub.drafters.llm import LlmProposer
    from starsd.hub.predraft import Predrafter

    proposer = LlmProposer(draft)
    predrafter = Predrafter(proposer, branches, rows)  # (records the draft's alternatives)
    fake = FakeSessions(proposer, draft.vocab_size, gamma)
    sessions = fake.open(n_sessions, PROMPT_TOKENS)
    times = []
    for _ in range(repeats):
        fake.propose(sessions)  # a verdict: the sessions move on, their proposals go out
        for s in sessions:
            predrafter.offer(b"%08d" % id(s), s.state)
        while predrafter.has_work():
            started = time.perf_counter()
            predrafter.step()
            times.append(time.perf_counter() - started)
    return times


def run(
    cfg: BenchConfig,
    procs: Processes,
    work: Path,
    draft: models.LoadedModel,
    run_targets: RunTargets,
    inputs: analytic.ModelInputs | None,
    emulate: Emulate | None = None,
    hub_cpus: set[int] | None = None,
) -> dict[str, Any]:
    """Every case against both hubs (and the emulated check, given ``emulate``); the pooled
    figures per (case, hub) and the comparison. ``hub_cpus``: where the hubs run, and the
    pre-draft steps are timed (``run_targets`` and ``emulate`` place the targets)."""
    repeats = QUICK_STEP_REPEATS if cfg.quick else STEP_REPEATS
    steps = {}
    for n in NS:
        with pinned(hub_cpus):
            times = predraft_steps(draft, n, cfg.gamma, repeats)
        steps[str(n)] = {
            "median_ms": 1e3 * statistics.median(times),
            "max_ms": 1e3 * max(times),
            "steps": len(times),
        }
        print(
            f"[predraft] one pre-draft step, {n} session(s): median "
            f"{steps[str(n)]['median_ms']:.2f} ms, largest {steps[str(n)]['max_ms']:.2f} ms",
            flush=True,
        )
    logs = {h: work / f"hub-predraft-{h}.log" for h in (WITH, WITHOUT)}
    hubs = start_hub_set(
        procs,
        {
            h: (
                log,
                ["--model", cfg.draft, "--stats-interval", str(STATS_INTERVAL_S), *HUB_ARGS[h]],
                hub_cpus,
            )
            for h, log in logs.items()
        },
    )
    rows: list[dict[str, Any]] = []
    emulated: list[dict[str, Any]] = []
    try:
        for n, temperature, order in cases(reps=QUICK_REPS if cfg.quick else REPS):
            for hub in order:
                rows.append(_one(cfg, run_targets, hubs[hub][1], logs[hub], hub, n, temperature))
        if emulate is not None:
            emulated = emulated_delay(cfg, emulate, {h: hubs[h][1] for h in hubs})
    finally:
        for proc, _ in hubs.values():
            stop(proc)
    return {**summary(rows, steps, inputs), "emulated": emulated_summary(emulated, steps)}


def emulated_delay(
    cfg: BenchConfig, emulate: Emulate, endpoints: dict[str, str]
) -> list[dict[str, Any]]:
    """Emulated targets (no CPU, no hits) against both hubs at each N, alternating."""
    out = []
    extra = [
        "--gamma",
        str(cfg.gamma),
        "--verify-ms",
        str(cfg.auto_verify_ms),
        "--verify-ms-per-token",
        str(cfg.auto_verify_per_token_ms),
    ]
    for n, _, order in cases(temperatures=(0.0,)):
        for hub in order:
            time.sleep(LEASE_WAIT_S)  # the last run's targets forgotten before this window
            r = emulate(endpoints[hub], n, f"-predraft-{hub}", extra)
            out.append(
                {
                    "n_targets": n,
                    "hub": hub,
                    "queue_wait_ms": r["queue_wait_ms"],
                    "proposal_wait_ms": r["proposal_wait_ms"],
                    "system_tokens_per_s": r["system_tokens_per_s"],
                    "hub_busy_fraction": r["hub_busy_fraction"],
                }
            )
            print(
                f"[predraft] emulated, {hub}, N={n}: queue wait {r['queue_wait_ms']:.2f} ms, "
                f"proposal wait p50/p99 {r['proposal_wait_ms']['p50']:.2f}/"
                f"{r['proposal_wait_ms']['p99']:.2f} ms",
                flush=True,
            )
    return out


def emulated_summary(
    rows: list[dict[str, Any]], steps: dict[str, dict[str, float]]
) -> dict[str, Any]:
    """Per N: the added queue wait and proposal wait with pre-drafting, against one step."""
    by_n: dict[str, dict[str, Any]] = {}
    for row in rows:
        by_n.setdefault(str(row["n_targets"]), {})[row["hub"]] = row
    for n, case in by_n.items():
        on, off = case.get(WITH), case.get(WITHOUT)
        if on is None or off is None:
            continue
        step = steps.get(n, {}).get("max_ms")
        added = on["queue_wait_ms"] - off["queue_wait_ms"]
        p50 = on["proposal_wait_ms"]["p50"] - off["proposal_wait_ms"]["p50"]
        case.update(
            added_queue_wait_ms=added,
            step_ms=step,
            added_proposal_wait_p50_ms=p50,
            added_proposal_wait_p99_ms=on["proposal_wait_ms"]["p99"]
            - off["proposal_wait_ms"]["p99"],
            within_one_step=step is not None and added <= step,
            # what the target sees: the wait from its DRAFT to its PROPOSAL
            proposal_wait_within_one_step=step is not None and p50 <= step,
        )
    checked = [c["within_one_step"] for c in by_n.values() if "within_one_step" in c]
    seen = [
        c["proposal_wait_within_one_step"]
        for c in by_n.values()
        if "proposal_wait_within_one_step" in c
    ]
    return {
        "by_n": by_n,
        "all_within_one_step": bool(checked) and all(checked),
        "proposal_wait_all_within_one_step": bool(seen) and all(seen),
    }


def _one(
    cfg: BenchConfig,
    run_targets: RunTargets,
    endpoint: str,
    log: Path,
    hub: str,
    n: int,
    temperature: float,
) -> dict[str, Any]:
    """N targets against one hub; their pooled figures from its log."""
    before_text = log.read_text()
    before = set(connected_targets(before_text))
    predraft_before = hub_line(before_text).get("predraft_s", 0.0)
    tag = f"predraft-{hub}-{n}-t{temperature}"
    extra = ["--gamma", "0", "--temperature", str(temperature)]
    rows = run_targets([endpoint] * n, tag, extra)
    time.sleep(2 * STATS_INTERVAL_S)  # the stats line after the targets' last jobs
    text = log.read_text()
    names = [name for name in connected_targets(text) if name not in before]
    pooled = pooled_targets(target_lines(text), names)
    tokens = [sum(len(r["token_ids"]) for r in t) for t in rows]
    seconds = [sum(len(r["token_ids"]) / r["stats"]["tokens_per_s"] for r in t) for t in rows]
    record = {
        "n_targets": n,
        "temperature": temperature,
        "hub": hub,
        "system_tokens_per_s": sum(k / s for k, s in zip(tokens, seconds, strict=True)),
        "predraft_s": hub_line(text).get("predraft_s", 0.0) - predraft_before,
        **pooled,
    }
    print(
        f"[predraft] {hub}, N={n}, temperature {temperature}: "
        f"{record['system_tokens_per_s']:.1f} tok/s, hit rate {record['hit_rate']:.2f} "
        f"(taken {record['taken_rate']:.2f}), queue "
        f"wait {record['queue_wait_ms']:.2f} ms, mean gamma {record['mean_gamma']:.2f}",
        flush=True,
    )
    return record


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of every number over a case's repetitions (one hub); ``runs`` counts them."""
    out: dict[str, Any] = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs)
    out["runs"] = len(runs)
    out["system_tokens_per_s_each"] = [r["system_tokens_per_s"] for r in runs]
    return out


def predicted(
    inputs: analytic.ModelInputs, row: dict[str, Any], hit_rate: float, taken_rate: float = 0.0
) -> float:
    """The model for one case: its N, its own acceptance at its mean gamma (rounded, >= 1),
    S and R as measured for the suite, pre-drafting answering ``hit_rate`` of the jobs, of
    which ``taken_rate`` were taken as pushed by their targets."""
    gamma = max(1, round(row["mean_gamma"]))
    alpha = analytic.alpha_from_mean_accepted(row["mean_accepted"], gamma)
    at = replace(
        analytic.at_gamma(inputs, gamma),
        alpha=alpha,
        hit_rate=hit_rate,
        taken_rate=min(taken_rate, hit_rate),
    )
    return analytic.predict(at, row["n_targets"]).system_tokens_per_s


def summary(
    rows: list[dict[str, Any]],
    steps: dict[str, dict[str, float]],
    inputs: analytic.ModelInputs | None,
) -> dict[str, Any]:
    """Per case: hit rate, queue wait with and without pre-drafting, the added wait against one
    pre-draft step, the throughput ratio and the model's."""
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault((f"{row['n_targets']}/{row['temperature']}", row["hub"]), []).append(row)
    by_case: dict[str, dict[str, Any]] = {}
    for (key, hub), runs in grouped.items():
        first = runs[0]
        by_case.setdefault(
            key, {"n_targets": first["n_targets"], "temperature": first["temperature"]}
        )[hub] = median_row(runs)
    for case in by_case.values():
        on, off = case.get(WITH), case.get(WITHOUT)
        if on is None or off is None:
            continue
        step = steps.get(str(case["n_targets"]), {})
        added = on["queue_wait_ms"] - off["queue_wait_ms"]
        case.update(
            hit_rate=on["hit_rate"],
            taken_rate=on.get("taken_rate", 0.0),
            queue_wait_ms_with=on["queue_wait_ms"],
            queue_wait_ms_without=off["queue_wait_ms"],
            added_wait_ms=added,
            step_ms=step.get("max_ms"),
            within_one_step=step.get("max_ms") is not None and added <= step["max_ms"],
            throughput_ratio=on["system_tokens_per_s"] / off["system_tokens_per_s"],
        )
        if inputs is not None:
            with_h = predicted(inputs, on, on["hit_rate"], on.get("taken_rate", 0.0))
            without = predicted(inputs, on, 0.0)
            on["predicted_system_tokens_per_s"] = with_h
            off["predicted_system_tokens_per_s"] = predicted(inputs, off, 0.0)
            case.update(
                predicted_with=with_h, predicted_without=without, predicted_ratio=with_h / without
            )
    checked = [c["within_one_step"] for c in by_case.values() if "within_one_step" in c]
    return {
        "cases": by_case,
        "step": steps,
        "rows": rows,
        "all_within_one_step": bool(checked) and all(checked),
    }


def markdown(predraft: dict[str, Any] | None) -> list[str]:
    """The cases as a markdown table."""
    if not predraft:
        return []
    lines = [
        "",
        "| N | temperature | hit rate (taken) | queue wait with / without ms | added | "
        "one step (max) ms | tok/s with / without | ratio | model ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in predraft["cases"].values():
        if "hit_rate" not in c:
            continue
        on, off = c[WITH], c[WITHOUT]
        lines.append(
            f"| {c['n_targets']} | {c['temperature']} | {c['hit_rate']:.2f} "
            f"({c.get('taken_rate', 0.0):.2f}) | "
            f"{c['queue_wait_ms_with']:.2f} / {c['queue_wait_ms_without']:.2f} | "
            f"{c['added_wait_ms']:+.2f} | {c['step_ms'] or 0:.2f} | "
            f"{on['system_tokens_per_s']:.1f} / {off['system_tokens_per_s']:.1f} | "
            f"{c['throughput_ratio']:.2f} | {c.get('predicted_ratio', 0):.2f} |"
        )
    lines.append(
        f"* added queue wait within one pre-draft step in every case: "
        f"{predraft['all_within_one_step']}"
    )
    emulated = (predraft.get("emulated") or {}).get("by_n") or {}
    for n, c in emulated.items():
        if "added_queue_wait_ms" in c:
            lines.append(
                f"* emulated targets, N={n}: queue wait {c[WITH]['queue_wait_ms']:.2f} / "
                f"{c[WITHOUT]['queue_wait_ms']:.2f} ms with / without (added "
                f"{c['added_queue_wait_ms']:+.2f}, one step {c['step_ms'] or 0:.2f}); proposal "
                f"wait p50 / p99 added {c['added_proposal_wait_p50_ms']:+.2f} / "
                f"{c['added_proposal_wait_p99_ms']:+.2f} ms"
            )
    return lines
