"""Benchmarks replayed under a profile pair (scripts/bench/replay.py): PROFILE parsing, the
hubs suite's profile reaching its hubs and emulators, and the plan's prediction beside each run.
Unit level: no processes."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from edge.handshake import TargetInfo
from scripts.bench import check_gpu_profile, replay
from scripts.bench import hubs as bench_hubs
from scripts.bench import run as bench_run
from scripts.bench.common import BenchConfig
from starsd import analytic, models
from starsd.profile import ProfileError

REPO = Path(__file__).resolve().parents[1]
DRAFT = str(REPO / "profiles/published-h100-llama31-8b-eagle3-draft.json")
TARGET = str(REPO / "profiles/published-h100-llama31-8b-target.json")
PAIR = f"{DRAFT},{TARGET}"


def test_missing_profile_is_refused_naming_the_file(tmp_path: Path) -> None:
    """Catches: a mistyped PROFILE path surfacing as a traceback from deep inside a hub or an
    emulator (minutes into the run) instead of one line naming the file."""
    missing = tmp_path / "nope-target.json"
    with pytest.raises(ProfileError, match=re.escape(str(missing))):
        replay.parse_pair(f"{DRAFT},{missing}")


def test_non_profile_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    """Catches: a benchmark result (valid JSON, not a profile) accepted as a profile."""
    other = tmp_path / "bench-scale.json"
    other.write_text(json.dumps({"runs": []}))
    with pytest.raises(ProfileError, match=re.escape(f"{other}: schema")):
        replay.parse_pair(f"{other},{TARGET}")


def test_draft_profile_given_as_target_is_refused() -> None:
    """Catches: the two files swapped or doubled (a draft profile's grid read as a target's),
    which would fail later on a missing ``step_ms`` or replay the wrong costs."""
    with pytest.raises(ProfileError, match=re.escape(f"{DRAFT}: kind: 'draft', expected a target")):
        replay.parse_pair(f"{DRAFT},{DRAFT}")
    with pytest.raises(
        ProfileError, match=re.escape(f"{TARGET}: kind: 'target', expected a draft")
    ):
        replay.parse_pair(f"{TARGET},{DRAFT}")


@pytest.mark.parametrize("spec", [DRAFT, f"{DRAFT},", f"{DRAFT},{TARGET},{TARGET}"])
def test_profile_needs_exactly_two_files(spec: str) -> None:
    """Catches: PROFILE=D.json alone (or a trailing comma) silently replaying half a pair."""
    with pytest.raises(ProfileError, match=re.escape("DRAFT.json,TARGET.json")):
        replay.parse_pair(spec)


@pytest.mark.parametrize("parse", [bench_run.parse_args, bench_hubs.parse_args])
def test_suites_refuse_a_bad_profile_with_one_line(
    parse: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches: a suite that accepts a bad --profile and starts its hubs anyway (the error
    then lost in a hub's log): both suites stop at parsing, naming the file."""
    missing = tmp_path / "missing.json"
    args = ["--suite", "scale"] if parse is bench_run.parse_args else []
    with pytest.raises(SystemExit) as exc:
        parse([*args, "--profile", f"{DRAFT},{missing}"])
    assert exc.value.code == 2
    assert f"{missing}: cannot read" in capsys.readouterr().err


def test_profile_option_fills_both_profiles() -> None:
    """Catches: --profile parsed but never reaching the config the suites read."""
    scale = bench_run.parse_args(["--suite", "scale", "--profile", PAIR])
    hubs = bench_hubs.parse_args(["--profile", PAIR])
    for cfg in (scale, hubs):
        assert (cfg.draft_profile, cfg.target_profile) == (DRAFT, TARGET)


def test_replayed_results_get_their_own_file() -> None:
    """Catches: a profile run overwriting the committed CPU results (results/bench-scale.json)."""
    assert replay.out_stem("bench-scale", "", "") == "bench-scale"
    assert replay.out_stem("bench-scale", DRAFT, TARGET) == "bench-scale-published-h100-llama31-8b"
    assert replay.out_stem("bench-hubs", "a/x-draft.json", "") == "bench-hubs-x-draft"
    assert replay.pair_name("d/abc.json", "t/xyz.json") == "abc+xyz"


def _hubs_cfg() -> bench_hubs.HubsConfig:
    return bench_hubs.HubsConfig(draft_profile=DRAFT, target_profile=TARGET)


def test_hubs_suite_passes_the_draft_profile_to_both_hubs(tmp_path: Path) -> None:
    """Catches: the hubs suite's hubs drafting with the draft LLM while its emulators follow
    the target profile (a replay of half the pair), or only one hub replaying."""
    hubs = bench_hubs.sweep_hubs(_hubs_cfg(), tmp_path, ({0}, {1}))
    assert set(hubs) == {"a", "b"}
    for _, args, _ in hubs.values():
        i = args.index("--draft-kind")
        assert args[i : i + 4] == ["--draft-kind", "emulated", "--draft-profile", DRAFT]
    plain = bench_hubs.sweep_hubs(bench_hubs.HubsConfig(), tmp_path, ({0}, {1}))
    assert all("--draft-kind" not in args for _, args, _ in plain.values())


class _Procs:
    """Records what would have been started."""

    def __init__(self) -> None:
        self.started: list[list[str]] = []

    def start(self, args: list[str], log: Path, cpus: Any = None) -> object:
        self.started.append(args)
        return object()


def test_hubs_suite_passes_the_target_profile_to_its_emulators(tmp_path: Path) -> None:
    """Catches: emulated targets verifying at --verify-ms (8 ms) instead of the profile's
    V(1, g) while the hubs replay the draft profile; and one hub's targets driven by the
    poller (cheaper) while two hubs' need the asyncio driver, which would bias the ratio."""
    procs: Any = _Procs()
    info = TargetInfo("bench-hubs", 100, "fp")
    bench_hubs.start_emulator(_hubs_cfg(), procs, tmp_path, info, ["A", "B"], 4, {0}, "two-4-0")
    (args,) = procs.started
    assert args[args.index("--profile") + 1] == TARGET
    plain = bench_hubs.HubsConfig()
    bench_hubs.start_emulator(plain, procs, tmp_path, info, ["A"], 4, {0}, "one-4-0")
    assert "--profile" not in procs.started[-1]
    for started in procs.started:
        assert started[started.index("--driver") + 1] == "asyncio"


def _record(mode: str, n: int, tok_s: float) -> dict[str, Any]:
    return {"mode": mode, "n_targets": n, "system_tokens_per_s": tok_s}


def test_hubs_plan_check_sums_each_hubs_share(tmp_path: Path) -> None:
    """Catches: the plan for two hubs taken as one hub with all N targets (it would predict
    no gain from the second hub) and an error measured against the wrong prediction."""
    cfg = _hubs_cfg()
    runs = [_record("one-hub", 16, 1000.0), _record("two-hubs", 16, 1800.0)]
    check = replay.hubs_check({"runs": runs}, cfg, tmp_path)
    assert check is not None and check["link_ms"] == 0.0
    inputs = replay.plan_inputs(replay.load_pair(DRAFT, TARGET), cfg.alpha, 0.0, 4, cfg.gamma)
    one = analytic.predict(inputs, 16).system_tokens_per_s
    two = 2 * analytic.predict(inputs, 8).system_tokens_per_s
    assert runs[0]["plan_predicted_system_tokens_per_s"] == pytest.approx(one)
    assert runs[1]["plan_predicted_system_tokens_per_s"] == pytest.approx(two)
    assert check["max_prediction_error"] == pytest.approx(
        max(abs(1000 / one - 1), abs(1800 / two - 1))
    )
    assert check["plan_saturated_ratio"] == pytest.approx(two / one)
    assert replay.hubs_check({"runs": []}, bench_hubs.HubsConfig(), tmp_path) is None


def test_scale_plan_check_follows_each_runs_hub_and_gamma() -> None:
    """Catches: the one-at-a-time hub predicted with batching, a fixed-gamma run predicted at
    the sweep's gamma, or the auto hub at a fixed one."""
    cfg = BenchConfig("scale", "target", "draft", draft_profile=DRAFT, target_profile=TARGET)
    runs = [
        _record("emulated-one-at-a-time", 32, 100.0),
        _record("emulated-batched", 32, 100.0),
        _record("gamma-fixed-2", 8, 100.0),
        _record("gamma-auto", 8, 100.0),
        _record("standalone", 1, 100.0),
    ]
    check = replay.scale_check({"runs": runs, "link_round_ms": 1.0}, cfg)
    assert check is not None
    pair = replay.load_pair(DRAFT, TARGET)
    at = replay.plan_inputs
    want = [
        analytic.predict(at(pair, cfg.alpha, 1e-3, 1, cfg.gamma), 32),
        analytic.predict(at(pair, cfg.alpha, 1e-3, cfg.max_batch, cfg.gamma), 32),
        analytic.predict(at(pair, cfg.alpha, 1e-3, cfg.max_batch, 2), 8),
        analytic.auto_gamma(at(pair, cfg.alpha, 1e-3, cfg.max_batch, cfg.gamma), 8, 16)[1],
    ]
    for record, p in zip(runs, want, strict=False):
        assert record["plan_predicted_system_tokens_per_s"] == pytest.approx(p.system_tokens_per_s)
    assert "plan_error" not in runs[-1]
    assert check["max_prediction_error"] == pytest.approx(runs[1]["plan_error"])
    assert want[0].system_tokens_per_s < want[1].system_tokens_per_s


def test_scale_plan_check_predicts_the_replay_with_both_serial_costs() -> None:
    """Catches the replay's prediction missing either serial cost per message (the hub's
    message path, 1 / its flooded rate; the load generator's, the poller's own measure or the
    asyncio driver's CPU per round), taking the wrong one, or adding the two (a batch's
    messages pass through both processes in turn: the slower sets the spread), and the
    fleet's prediction (for targets on machines of their own) charged the load generator's."""
    cfg = BenchConfig("scale", "target", "draft", draft_profile=DRAFT, target_profile=TARGET)
    runs = [_record("emulated-batched", n, 100.0 * n) for n in (8, 64)]
    runs[0].update(mean_accepted=1.0, emulator_cpu_fraction=0.08)  # 400 rounds/s: 0.2 ms
    runs[1].update(mean_accepted=1.0, emulator_cpu_fraction=0.9, load_generator_ms_per_round=0.05)
    result = {"runs": runs, "link_round_ms": 1.0, "hub_rounds_per_s": 10_000.0}
    check = replay.scale_check(result, cfg)
    assert check is not None and check["hub_message_ms"] == pytest.approx(0.1)
    base = replay.plan_inputs(replay.load_pair(DRAFT, TARGET), cfg.alpha, 1e-3, 64, cfg.gamma)
    assert not base.messages_share_drafter  # the emulated drafter sleeps: no CPU to share

    def at(n: int, per_message_s: float) -> float:
        inputs = dataclasses.replace(base, per_message_s=per_message_s)
        return analytic.predict(inputs, n).system_tokens_per_s

    for record, slower_s in zip(runs, (2e-4, 1e-4), strict=True):  # generator's, hub's
        n = record["n_targets"]
        assert record["plan_predicted_system_tokens_per_s"] == pytest.approx(at(n, slower_s))
        assert record["plan_fleet_tokens_per_s"] == pytest.approx(at(n, 1e-4))
        assert record["plan_without_message_costs_tokens_per_s"] == pytest.approx(at(n, 0.0))
    assert runs[0]["plan_predicted_system_tokens_per_s"] < runs[0]["plan_fleet_tokens_per_s"]
    assert runs[1]["plan_predicted_system_tokens_per_s"] == runs[1]["plan_fleet_tokens_per_s"]
    errors = [
        abs(r["system_tokens_per_s"] / r["plan_predicted_system_tokens_per_s"] - 1) for r in runs
    ]
    assert check["max_prediction_error"] == pytest.approx(max(errors))
    bare = [r["plan_error_without_message_costs"] for r in runs]
    assert check["max_prediction_error_without_message_costs"] == pytest.approx(max(bare))


def test_check_gpu_profile_skips_cleanly_without_cuda(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches: make check-gpu failing (or profiling on the CPU under a cuda name) on a machine
    without CUDA: one line, exit 0, nothing written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = tmp_path / "plan.json"
    assert check_gpu_profile.main(["--out-dir", str(tmp_path), "--plan", str(plan)]) == 0
    assert capsys.readouterr().out.strip() == check_gpu_profile.SKIP_LINE
    assert list(tmp_path.iterdir()) == []


def test_check_gpu_profile_profiles_both_drafters_and_plans_from_each() -> None:
    """Catches make check-gpu profiling only the draft LLM (the pair's default drafter is its
    EAGLE-3 head, which needs its target to load) or planning from a profile it never wrote."""
    args = check_gpu_profile.parse_args(["--out-dir", "p", "--plan", "r/plan-cuda.json"])
    cmds = check_gpu_profile.commands(args)
    written = {c[c.index("--out") + 1] for c in cmds if c[0] == "profile"}
    head = next(c for c in cmds if c[:2] == ["profile", "draft"] and "eagle3" in c)
    assert head[head.index("--target") + 1] == args.target
    plans = [c for c in cmds if c[0] == "plan"]
    assert [c[c.index("--json") + 1] for c in plans] == ["r/plan-cuda.json", "r/plan-cuda-llm.json"]
    for plan in plans:
        assert {plan[plan.index("--draft") + 1], plan[plan.index("--target") + 1]} <= written


@pytest.mark.gpu
def test_check_gpu_profile_profiles_and_plans_on_cuda(tmp_path: Path) -> None:
    """Catches: the CUDA profiles or the plan from them failing on a GPU machine (a cell not
    synchronised, a profile the planner refuses)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    plan = tmp_path / "plan-cuda.json"
    assert check_gpu_profile.main(["--out-dir", str(tmp_path), "--plan", str(plan)]) == 0
    written = json.loads(plan.read_text())
    assert written["sizing"]["kinds"]
    for path in tmp_path.glob("measured-cuda-*.json"):
        assert json.loads(path.read_text())["machine"]["device"].startswith("cuda")


def test_stand_in_weights_keep_the_models_fingerprint(
    tmp_path: Path, llama_pair: tuple[Path, Path]
) -> None:
    """Catches stand-in weights (a GPU machine the real ones cannot reach) that are not the
    model's tensors (names, shapes, dtype, file size): the profile would then fingerprint
    another model, and the planner would refuse it or plan a different one."""
    from safetensors.torch import load_file, save_file

    from scripts.train.real_target import saved_tensors
    from starsd.profile import model_fingerprint

    real, stand_in = tmp_path / "real", tmp_path / "stand-in"
    loaded = models.load_causal_lm(llama_pair[0], lean=False)
    for where in (real, stand_in):
        where.mkdir()
        (where / "config.json").write_text((llama_pair[0] / "config.json").read_text())
    save_file(saved_tensors(loaded.model), str(real / "model.safetensors"), {"format": "pt"})
    assert not check_gpu_profile.has_weights(stand_in)
    check_gpu_profile.write_stand_in_weights(stand_in, seed=7)  # not the pair's seed
    assert check_gpu_profile.has_weights(stand_in)
    assert check_gpu_profile.has_stand_in_weights(stand_in)
    assert not check_gpu_profile.has_stand_in_weights(real)
    assert model_fingerprint(stand_in)["id"] == model_fingerprint(real)["id"]
    ours, theirs = load_file(stand_in / "model.safetensors"), load_file(real / "model.safetensors")
    assert not torch.equal(
        ours["model.layers.0.mlp.up_proj.weight"], theirs["model.layers.0.mlp.up_proj.weight"]
    )
    profile = tmp_path / "p.json"  # a valid profile: the note is written through write_profile
    toy = json.loads((REPO / "profiles/toy-target-cpu.json").read_text())
    profile.write_text(json.dumps({**toy, "notes": "measured"}))
    check_gpu_profile.note_stand_in(profile)
    assert json.loads(profile.read_text())["notes"] == ["measured", check_gpu_profile.STAND_IN_NOTE]


def test_check_gpu_profile_plans_with_each_drafters_measured_acceptance(tmp_path: Path) -> None:
    """Catches the CUDA plans run on the default alpha, or on the other drafter's acceptance:
    each plan takes its own drafter's mean accepted tokens at gamma 4 from the training
    report."""
    from starsd import plan as planning

    report = tmp_path / "train.json"
    evaluation = {"eagle3": {"4": {"mean_accepted": 2.0}}, "llm": {"4": {"mean_accepted": 1.0}}}
    report.write_text(json.dumps({"evaluation": evaluation}))
    files = check_gpu_profile.acceptance_files(report, tmp_path)
    args = check_gpu_profile.parse_args(["--out-dir", "p", "--plan", "r/plan-cuda.json"])
    plans = {
        c[c.index("--json") + 1]: c
        for c in check_gpu_profile.commands(args, files)
        if c[0] == "plan"
    }
    head, llm = plans["r/plan-cuda.json"], plans["r/plan-cuda-llm.json"]
    assert "smollm2-eagle3" in head[head.index("--draft") + 1]
    alphas = {
        name: planning.alpha_from_file(c[c.index("--acceptance") + 1])
        for name, c in (("head", head), ("llm", llm))
    }
    for name, accepted in (("head", 2.0), ("llm", 1.0)):
        assert sum(alphas[name] ** i for i in range(1, 5)) == pytest.approx(accepted, rel=1e-3)
    assert check_gpu_profile.acceptance_files(tmp_path / "absent.json", tmp_path) == {}


def _line(i: int, ids: list[int], rate: float, rounds: int = 0, accepted: int = 0) -> dict:
    stats = {"tokens_per_s": rate, "rounds": rounds, "accepted": accepted}
    return {"id": i, "token_ids": ids, "stats": stats}


def test_check_gpu_pair_reads_decode_rates_and_flags_a_different_output() -> None:
    """Catches the CUDA pair check timing model loading (its rate must be tokens over each
    sequence's own decode seconds), averaging acceptance per sequence instead of per round, or
    calling outputs identical when one hub run differs from the target alone."""
    from scripts.bench import check_gpu_pair

    alone = check_gpu_pair.decode_figures([_line(1, [7] * 10, 10.0), _line(0, [5] * 30, 30.0)])
    assert alone["tokens_per_s"] == pytest.approx(40 / 2.0)
    assert alone["token_ids"] == [[5] * 30, [7] * 10]  # in id order
    hub = check_gpu_pair.decode_figures(
        [_line(0, [5] * 30, 60.0, rounds=10, accepted=20), _line(1, [7] * 10, 20.0, 1, 0)]
    )
    assert hub["mean_accepted"] == pytest.approx(20 / 11)
    same = check_gpu_pair.summary({"standalone": [alone], "hub": [hub]})
    assert same["identical"] and same["hub_over_standalone"] == pytest.approx(2.0)
    other = dict(hub, token_ids=[[5] * 30, [7] * 9 + [8]])
    assert not check_gpu_pair.summary({"standalone": [alone], "hub": [hub, other]})["identical"]


def test_check_gpu_pair_keeps_the_hubs_summary_and_errors() -> None:
    """Catches the pair check dropping what explains a shortfall on a borrowed machine: the
    hub's closing summary (only the lines after "hub stopped", not the periodic ones) and every
    ERROR line (a drafting round that raised), but not an INFO line quoting an ERROR reply."""
    from scripts.bench import check_gpu_pair

    log = "\n".join(
        [
            "d t0 starsd.hub INFO hub: targets=1 jobs=2 (periodic)",
            "d t1 starsd.hub ERROR drafting a batch of 1 failed; ending its sessions",
            "Traceback (most recent call last):",
            "d t2 starsd.hub INFO -> 3a09b00091 ERROR SHUTTING_DOWN: hub is stopping",
            "d t3 starsd.hub INFO hub stopped after 9.0 s; summary:",
            "d t4 starsd.hub INFO hub: targets=1 jobs=62 failed=1",
            "d t5 starsd.hub INFO target ab/starsd-target: sessions=6 rounds=67",
        ]
    )
    report = check_gpu_pair.hub_report(log)
    assert report["hub_summary"] == [
        "hub: targets=1 jobs=62 failed=1",
        "target ab/starsd-target: sessions=6 rounds=67",
    ]
    assert report["hub_errors"] == [log.splitlines()[1]]
    assert check_gpu_pair.hub_report("no summary") == {"hub_summary": [], "hub_errors": []}


def test_check_gpu_pair_skips_cleanly_without_cuda(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches make check-gpu's pair step failing (or running on the CPU) without CUDA."""
    from scripts.bench import check_gpu_pair

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "pair.json"
    assert check_gpu_pair.main(["--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == check_gpu_pair.SKIP_LINE
    assert not out.exists()


@pytest.mark.slow
def test_check_gpu_backends_without_cuda_keeps_the_gpu_report(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches make check-gpu on a CPU machine replacing the committed report of the last GPU
    machine with a CPU-only one (every provider skipped)."""
    from scripts.bench import check_gpu_backends

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "backends.json"
    args = ["--out", str(out), "--export", str(tmp_path / "export"), "--prompts", "1"]
    assert check_gpu_backends.main([*args, "--max-new-tokens", "4"]) == 0
    assert not out.exists() and "not written" in capsys.readouterr().out


def test_the_real_sweeps_plan_reads_the_drafters_profile_and_the_emulated_verify() -> None:
    """Catches the CPU sweep's plan reading another drafter's profile silently, taking the
    targets' verify from anywhere but --verify-ms, predicting the gamma comparison's runs
    (whose emulated targets verify at other costs) with the sweep's targets, or leaving out
    the hub's message path taking turns with the CPU drafter (20% over at N = 128 without)."""
    cpu = str(REPO / bench_run.CPU_DRAFT_PROFILE)
    cfg = BenchConfig(
        "scale", "target", str(models.TOY_DRAFT_DIR), verify_ms=8.0, plan_draft_profile=cpu
    )
    runs = [_record("emulated-batched", 8, 1000.0), _record("gamma-fixed-2", 8, 1000.0)]
    result = {"runs": runs, "link_round_ms": 1.0, "hub_rounds_per_s": 10_000.0}
    check = replay.scale_check(result, cfg)
    assert check is not None and "skipped" not in check
    draft = replay.load_profile(cpu, "draft")
    targets = replay.emulated_targets(8.0, draft.gammas("service_ms"))
    assert targets.seconds("verify_ms")[(1, 2)] == targets.seconds("step_ms")[(1, 0)] == 0.008
    pair = replay.ProfilePair(draft, targets)
    inputs = replay.plan_inputs(pair, cfg.alpha, 1e-3, 64, 4, drafter_computes=True)
    assert inputs.messages_share_drafter  # the real drafter computes on the hub's CPU
    want = analytic.predict(dataclasses.replace(inputs, per_message_s=1e-4), 8)
    assert runs[0]["plan_predicted_system_tokens_per_s"] == pytest.approx(want.system_tokens_per_s)
    apart = dataclasses.replace(inputs, per_message_s=1e-4, messages_share_drafter=False)
    assert want.system_tokens_per_s < analytic.predict(apart, 8).system_tokens_per_s
    assert "plan_error" not in runs[1]
    other = dataclasses.replace(cfg, draft=str(models.TOY_TARGET_DIR))
    skipped = replay.scale_check({**result, "runs": [_record("emulated-batched", 8, 1.0)]}, other)
    assert skipped is not None and "toy-draft-cpu.json" in skipped["skipped"]
    assert replay.scale_check(result, dataclasses.replace(cfg, plan_draft_profile="")) is None
