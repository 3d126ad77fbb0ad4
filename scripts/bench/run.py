"""StarSD benchmarks: every mode side by side in one run, next to the analytic model.

    python -m scripts.bench.run --suite main  [--quick]  # standalone, centralized, 1:1, 1-for-N
    python -m scripts.bench.run --suite scale [--quick]  # emulated targets, N up to 128, N_full
    python -m scripts.bench.run --suite lan   [--quick]  # hub and targets in separate namespaces

Writes results/bench[-scale|-lan].json (``runs``: one record per (mode, N)) and PNG plots, and
prints a markdown table. Greedy decoding on the default model pair unless --target/--draft.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from edge.handshake import TargetInfo
from scripts.bench import assisted as bench_assisted
from scripts.bench import predraft as bench_predraft
from scripts.bench import replay, scale_report
from scripts.bench import scale as bench_scale
from scripts.bench import verify as bench_verify
from scripts.bench.common import BenchConfig, hub_overhead, hub_stats, run_record
from scripts.bench.harness import (
    REPO,
    Processes,
    run_suite,
    start_hub,
    start_hubs,
    stop,
)
from scripts.bench.inproc import PROMPTS, bench_centralized, bench_standalone, eagle_drafter
from scripts.bench.run_report import label, markdown, plot
from scripts.bench.targets import (
    busy_between,
    decode_seconds,
    proposal_bytes,
    run_targets,
    targets_record,
)
from starsd import analytic, models, transport
from starsd.hub.drafters.base import Proposer
from starsd.hub.drafters.llm import LlmProposer

# ---------------------------------------------------------------------- suites


def suite_main(cfg: BenchConfig, procs: Processes, work: Path) -> dict:
    """standalone, centralized, distributed 1:1 and one-for-many on real models."""
    torch.set_num_threads(1)
    phases = bench_scale.Phases()
    target, draft = models.load_causal_lm(cfg.target), models.load_causal_lm(cfg.draft)
    print("[main] standalone and centralized (in process) ...", flush=True)
    standalone, t_ar, reference = bench_standalone(target, cfg)
    central, measured = bench_centralized(target, LlmProposer(draft), cfg)
    central_eagle, measured_eagle = bench_centralized(target, eagle_drafter(cfg), cfg)
    info = TargetInfo(
        "bench", target.vocab_size, target.tokenizer_fingerprint, models.hidden_size(target)
    )
    overhead = hub_overhead(cfg, procs, work, info)
    link = overhead["round_ms"] / 1e3
    alpha = analytic.alpha_from_mean_accepted(measured["mean_accepted"], cfg.gamma)
    inputs = analytic.ModelInputs(
        alpha, cfg.gamma, measured["draft_s"], measured["verify_s"], link, t_ar
    )
    tokens = analytic.expected_tokens_per_round(alpha, cfg.gamma)
    central["predicted_system_tokens_per_s"] = tokens / (inputs.draft_s + inputs.verify_s)
    runs = [standalone, central, central_eagle]
    plan = [
        HubRun("distributed-1to1", max(cfg.ns)),
        *[HubRun("one-for-many", n) for n in cfg.ns],
        HubRun("one-for-many", max(cfg.ns), "eagle"),
        *batched_plan(cfg),
    ]
    curve = service_points(LlmProposer(draft), target.vocab_size, cfg.gamma)
    with phases("modes"):
        for run in plan:
            print(
                f"[main] {run.mode} ({run.kind} drafter, max-batch {run.max_batch}) with "
                f"{run.n} target process(es) x {run.concurrency} sequence(s) ...",
                flush=True,
            )
            runs.append(hub_run(cfg, procs, work, info, run, inputs, curve))
    print(
        "[main] one hub + one target vs transformers' assisted generation and centralized, "
        "alternated ...",
        flush=True,
    )
    with phases("paired"):
        paired = bench_assisted.run(
            cfg,
            procs,
            work,
            target,
            draft,
            PROMPTS,
            reference,
            central=lambda: _rate(bench_centralized(target, LlmProposer(draft), cfg)[0]),
            run_target=lambda ep, tag, extra: run_targets(cfg, procs, work, [ep], tag, extra=extra)[
                0
            ],
        )
    runs += paired_records(paired)
    print(
        "[main] pre-drafting: hit rate and queue wait, N = 1, 2, 4, greedy and sampled ...",
        flush=True,
    )
    hub_cpus, target_cpus = bench_scale.placement()  # hubs on the first CPU, as in bench-scale
    with phases("predraft"):
        predraft = bench_predraft.run(
            cfg,
            procs,
            work,
            draft,
            lambda eps, tag, extra: run_targets(
                cfg, procs, work, eps, tag, extra=extra, cpus=target_cpus
            ),
            scale_report.batched_inputs(inputs, cfg.max_batch, curve) or inputs,
            lambda ep, n, tag, extra: bench_scale.emulated_run(
                cfg, procs, work, info, ep, n, target_cpus, tag, extra
            ),
            hub_cpus,
        )
    print(
        "[main] batched verification: one target at --concurrency 8 vs 1, through a hub and "
        "standalone, alternated ...",
        flush=True,
    )
    with phases("verify"):
        verify = bench_verify.run(
            procs, work, cfg.target, cfg.draft, 1 if cfg.quick else 3, cfg.max_new_tokens, cfg.gamma
        )
    base = standalone["system_tokens_per_s"]
    return {
        "runs": runs,
        "model_inputs": analytic.inputs_as_json(inputs),
        "hub_overhead": overhead,
        "service_curve_in_process": [{"batch": b, "ms": 1e3 * t} for b, t in curve],
        "batched_vs_one_at_a_time": batched_comparison(runs),
        # one hub + one target vs transformers' assisted generation (scripts/bench/assisted.py)
        "vs_hf_assisted": paired,
        # pre-draft hit rate and queue wait, with and without (scripts/bench/predraft.py)
        "predraft": predraft,
        # one target at --concurrency 8 vs 1, hub and standalone (scripts/bench/verify.py)
        "batched_verification": verify,
        "phase_s": phases.seconds,
        "eagle": {
            "draft_ms_per_round": 1e3 * measured_eagle["draft_s"],
            "llm_draft_ms_per_round": 1e3 * measured["draft_s"],
            "mean_accepted": measured_eagle["mean_accepted"],
            "llm_mean_accepted": measured["mean_accepted"],
        },
        "speedup_vs_standalone": {
            f"{label(r)}/{r['n_targets']}": r["system_tokens_per_s"] / base for r in runs
        },
    }


def _rate(record: dict) -> dict[str, Any]:
    """A record as one repetition of the paired comparison."""
    return {"tokens_per_s": record["system_tokens_per_s"], "mean_accepted": record["mean_accepted"]}


def paired_records(paired: dict[str, Any]) -> list[dict]:
    """The paired comparison's medians as ``runs`` records (N = 1 each)."""
    out = []
    for mode, rate in paired["median_tokens_per_s"].items():
        name = {bench_assisted.CENTRAL: "centralized-paired"}.get(mode, mode)
        out.append(
            run_record(
                name,
                1,
                system_tokens_per_s=rate,
                per_target_tokens_per_s=rate,
                mean_accepted=paired["mean_accepted"].get(mode),
                repetitions=len(paired["tokens_per_s"][mode]),
            )
        )
    return out


BATCHED_MODE, ONE_AT_A_TIME_MODE = "one-for-many-batched", "one-for-many-one-at-a-time"
BATCHED_NS, BATCHED_CONCURRENCY = (2, 4), 2


@dataclass(frozen=True)
class HubRun:
    """One multi-process run of the main suite."""

    mode: str
    n: int  # target processes
    kind: str = "llm"
    max_batch: int = BenchConfig.max_batch
    concurrency: int = 1  # sequences each target keeps in flight


def batched_plan(cfg: BenchConfig) -> list[HubRun]:
    """One hub serving N = 2 and 4 targets of 2 sequences each, batched (``cfg.max_batch``)
    and one at a time (``--max-batch 1``) back to back, the first of each pair alternating."""
    plan = []
    for i, n in enumerate(BATCHED_NS):
        pair = [
            HubRun(BATCHED_MODE, n, max_batch=cfg.max_batch, concurrency=BATCHED_CONCURRENCY),
            HubRun(ONE_AT_A_TIME_MODE, n, max_batch=1, concurrency=BATCHED_CONCURRENCY),
        ]
        plan += pair if i % 2 == 0 else pair[::-1]
    return plan


def batched_comparison(runs: list[dict]) -> dict[str, dict[str, float]]:
    """System tokens/s of the batched and the one-at-a-time hub per N, and their ratio."""
    out: dict[str, dict[str, float]] = {}
    for r in runs:
        if r["mode"] in (BATCHED_MODE, ONE_AT_A_TIME_MODE):
            key = "batched" if r["mode"] == BATCHED_MODE else "one_at_a_time"
            out.setdefault(str(r["n_targets"]), {})[key] = r["system_tokens_per_s"]
    for row in out.values():
        if row.get("batched") and row.get("one_at_a_time"):
            row["ratio"] = row["batched"] / row["one_at_a_time"]
    return out


def service_points(
    proposer: Proposer,
    vocab_size: int,
    gamma: int,
    sizes: tuple[int, ...] = (1, 2, 4, 8),
    repeats: int = 3,
) -> list[tuple[int, float]]:
    """S(B) of the hub's LLM proposer in process, for the batched runs' model (seconds)."""
    import statistics

    from scripts.bench.service import FakeSessions, time_sizes

    times = time_sizes(FakeSessions(proposer, vocab_size, gamma), sizes, repeats)
    return [(b, statistics.median(t)) for b, t in sorted(times.items())]


def hub_run(
    cfg: BenchConfig,
    procs: Processes,
    work: Path,
    info: TargetInfo,
    run: HubRun,
    inputs: analytic.ModelInputs,
    curve: list[tuple[int, float]] | None = None,
) -> dict:
    """``run.n`` target processes and fresh hubs: one shared (one-for-many) or one each (1:1)."""
    mode, n, kind = run.mode, run.n, run.kind
    n_hubs = n if mode == "distributed-1to1" else 1
    model, extra = (
        (cfg.eagle, ["--draft-kind", "eagle", "--target", cfg.target])
        if kind == "eagle"
        else (cfg.draft, [])
    )
    hubs = start_hubs(
        procs,
        model,
        [work / f"hub-{mode}-{kind}-{n}-{i}.log" for i in range(n_hubs)],
        "--gamma",
        str(cfg.gamma),
        "--max-batch",
        str(run.max_batch),
        *extra,
    )
    endpoints = [ep for _, ep in hubs]
    before = [transport.run_loop(hub_stats(ep, info)) for ep in endpoints]
    rows = run_targets(
        cfg, procs, work, (endpoints * n)[:n], f"{mode}-{kind}-{n}", concurrency=run.concurrency
    )
    after = [transport.run_loop(hub_stats(ep, info)) for ep in endpoints]
    for proc, _ in hubs:
        stop(proc)
    decode_wall = max(decode_seconds(t, run.concurrency) for t in rows)
    busy = sum(a.busy_s - b.busy_s for a, b in zip(after, before, strict=True)) / len(hubs)
    queue_ms = sum(busy_between(b, a)[1] for a, b in zip(after, before, strict=True)) / len(hubs)
    jobs = sum(a.jobs - b.jobs for a, b in zip(after, before, strict=True))
    batches = sum(a.batches - b.batches for a, b in zip(after, before, strict=True))
    per_hub = 1 if mode == "distributed-1to1" else n * run.concurrency  # sessions per hub
    model_rate = predicted(inputs, per_hub, run, curve) if kind == "llm" else None
    record = targets_record(
        mode,
        rows,
        cfg.gamma,
        run.concurrency,
        hub_busy_fraction=min(1.0, busy / decode_wall),
        queue_wait_ms=queue_ms,
        bytes_per_round=proposal_bytes(cfg.gamma),
        draft_kind=kind,
        predicted_system_tokens_per_s=None if model_rate is None else len(hubs) * model_rate,
        max_batch=run.max_batch,
        mean_batch_size=jobs / batches if batches else None,
    )
    if kind == "eagle":  # features of the committed positions travel up with each DRAFT
        record["feature_bytes_per_round"] = (record["mean_accepted"] + 1) * info.feature_width * 2
        record["bytes_per_round"] += record["feature_bytes_per_round"]
    return record


def predicted(
    inputs: analytic.ModelInputs, sessions: int, run: HubRun, curve: list[tuple[int, float]] | None
) -> float | None:
    """The model's system tokens/s for one hub serving ``sessions``: per job for a hub that
    drafts one at a time, with S(B) for a batched one (None until starsd.analytic has S(B))."""
    if run.max_batch == 1 or run.mode != BATCHED_MODE:
        return analytic.predict(inputs, sessions).system_tokens_per_s
    with_curve = scale_report.batched_inputs(inputs, run.max_batch, curve or [])
    if with_curve is None:
        return None
    return analytic.predict(with_curve, sessions).system_tokens_per_s


# The committed toy draft's profile on this machine: the plan of the CPU sweep reads it
CPU_DRAFT_PROFILE = "profiles/toy-draft-cpu.json"


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    """argparse -> BenchConfig (--quick shortens every run)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=["main", "scale", "lan"], default="main")
    p.add_argument("--target", default=str(models.TOY_TARGET_DIR))
    p.add_argument("--draft", default=str(models.TOY_DRAFT_DIR))
    p.add_argument("--eagle", default=BenchConfig.eagle, help="EAGLE head for the target")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--gamma", type=int, default=BenchConfig.gamma)
    p.add_argument("--alpha", type=float, default=BenchConfig.alpha)
    p.add_argument("--verify-ms", type=float, default=BenchConfig.verify_ms)
    p.add_argument("--delay-ms", type=float, default=BenchConfig.delay_ms)
    p.add_argument("--rate-mbit", type=float, default=BenchConfig.rate_mbit)
    p.add_argument(
        "--max-batch",
        type=int,
        default=BenchConfig.max_batch,
        help="the batched hub's --max-batch (the baseline hub runs with 1)",
    )
    p.add_argument(
        "--scale-ns",
        type=int,
        nargs="+",
        default=list(BenchConfig.scale_ns),
        help="scale suite: emulated targets per step (default up to 256; --quick 128)",
    )
    p.add_argument(
        "--draft-profile",
        default="",
        help="scale suite: the hubs replay this draft profile's S(B, g) (--draft-kind emulated)",
    )
    p.add_argument(
        "--target-profile",
        default="",
        help="scale suite: the emulated targets' verify and alone times follow this profile",
    )
    p.add_argument(
        "--plan-draft-profile",
        default=CPU_DRAFT_PROFILE,
        help="scale suite with the real drafter: the plan of the sweep reads its S(B, g) from "
        "this draft profile ('': no plan check; one of another model is skipped, saying so)",
    )
    replay.add_profile_option(p)
    p.add_argument("--out-dir", default=BenchConfig.out_dir)
    a = vars(p.parse_args(argv))
    replay.resolve_profiles(p, a)
    a["scale_ns"] = tuple(a["scale_ns"])
    if a["quick"]:
        a.update(max_new_tokens=32, ns=(1, 2), duration=2.0, calibration=1.0, warmup=0.5)
        if a["scale_ns"] == BenchConfig.scale_ns:
            a["scale_ns"] = tuple(n for n in a["scale_ns"] if n <= 128)
    return BenchConfig(**a)


def suite_lan(cfg: BenchConfig, procs: Processes, work: Path) -> dict:
    """Hub and targets on separate hosts (network namespaces), behind a delaying proxy."""
    from scripts.emulate import netem, netem_namespaces
    from scripts.emulate.netem_proxy import ProxyConfig

    ok, why = netem_namespaces.available()
    if not ok:
        print(
            f"[lan] network namespaces unavailable ({why}): falling back to loopback, "
            "with the same delay proxy",
            flush=True,
        )
        return lan_loopback(cfg, procs, work)
    netem_namespaces.cleanup_stale()
    runs = []
    with netem_namespaces.Namespaces(max(cfg.ns)) as net:
        prefix = ["ip", "netns", "exec", net.hub.netns]
        # Plain text inside namespaces this run created and removes: --insecure says so.
        hub, _ = start_hub(
            procs,
            cfg.draft,
            work / "hub-lan.log",
            "--gamma",
            str(cfg.gamma),
            "--insecure",
            bind=f"tcp://{net.hub.ip}:5555",
            prefix=prefix,
        )
        proxy = ProxyConfig(
            net.hub.ip, 5555, net.hub.ip, 6000, cfg.delay_ms, cfg.rate_mbit, spin_ms=0.0
        )
        net.run_in(net.hub, netem.proxy_argv(proxy))
        time.sleep(1.0)
        for n in cfg.ns:
            print(f"[lan] one hub + {n} target host(s), {cfg.delay_ms} ms each way ...", flush=True)
            rows = run_targets(
                cfg,
                procs,
                work,
                [f"tcp://{net.hub.ip}:6000"] * n,
                f"lan-{n}",
                [["ip", "netns", "exec", h.netns] for h in net.targets[:n]],
            )
            runs.append(
                targets_record(
                    "one-for-many", rows, cfg.gamma, bytes_per_round=proposal_bytes(cfg.gamma)
                )
            )
        stop(hub)
    return {"runs": runs, "network": "namespaces", **_link(cfg)}


def lan_loopback(cfg: BenchConfig, procs: Processes, work: Path) -> dict:
    """The same measurement on loopback, the delay proxy in front of the hub."""
    from scripts.emulate.netem_proxy import DelayProxy, ProxyConfig

    hub, endpoint = start_hub(procs, cfg.draft, work / "hub-lan.log", "--gamma", str(cfg.gamma))
    port = int(endpoint.rsplit(":", 1)[1])
    proxy = DelayProxy(
        ProxyConfig("127.0.0.1", port, delay_ms=cfg.delay_ms, rate_mbit=cfg.rate_mbit)
    )
    host, proxy_port = proxy.start_background()
    runs = []
    try:
        for n in cfg.ns:
            rows = run_targets(cfg, procs, work, [f"tcp://{host}:{proxy_port}"] * n, f"lan-{n}")
            runs.append(
                targets_record(
                    "one-for-many", rows, cfg.gamma, bytes_per_round=proposal_bytes(cfg.gamma)
                )
            )
    finally:
        proxy.stop_background()
        stop(hub)
    return {"runs": runs, "network": "loopback", **_link(cfg)}


def _link(cfg: BenchConfig) -> dict:
    return {"link": {"one_way_delay_ms": cfg.delay_ms, "rate_mbit": cfg.rate_mbit}}


SUITES = {"main": suite_main, "scale": bench_scale.suite_scale, "lan": suite_lan}
OUT_NAMES = {"main": "bench", "scale": "bench-scale", "lan": "bench-lan"}


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    result = run_suite(
        "bench",
        lambda procs, work: {
            "suite": cfg.suite,
            "config": asdict(cfg),
            **SUITES[cfg.suite](cfg, procs, work),
        },
    )
    if result is None:
        return 130
    result["machine"] = machine()
    if cfg.suite == "scale":
        result["plan_check"] = replay.scale_check(result, cfg)
    name = replay.out_stem(OUT_NAMES[cfg.suite], cfg.draft_profile, cfg.target_profile)
    out = REPO / cfg.out_dir / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"), BATCHED_CONCURRENCY)
    print(scale_report.markdown(result) if cfg.suite == "scale" else markdown(result))
    print({k: v for k, v in result.items() if k not in ("runs", "config")})
    check = result.get("plan_check")
    if check and "skipped" in check:
        print(f"plan check skipped: {check['skipped']}")
    elif check:
        print(replay.report(result["runs"], check))
    print(f"wrote {out} and {out.with_suffix('.png')} in {result['wall_s']:.0f} s")
    return 0


def machine() -> dict[str, Any]:
    """Where the figures were measured."""
    import platform

    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


if __name__ == "__main__":
    sys.exit(main())
