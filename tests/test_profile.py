"""Profiles (``starsd profile``) and the planner (``starsd plan``): schema, validation, and the
plan's numbers against the analytic model and the hub's gamma rule."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from starsd import analytic, cli, goodput, plan_report, profile, profile_cli
from starsd import plan as planning
from starsd.profile import ProfileError
from starsd.service import ServiceCurve
from starsd.tree_shapes import TreeShape, ranked_tree

REPO = Path(__file__).resolve().parent.parent
BATCHES = (1, 2, 4, 8)
GAMMAS = (1, 2, 4, 8)


def cell(ms: float, batch: int = 1, gamma: int | None = None) -> dict[str, Any]:
    """A grid cell of ``ms`` milliseconds."""
    out: dict[str, Any] = {"batch": batch, "median_ms": ms, "p10_ms": ms * 0.9, "p90_ms": ms * 1.2}
    return out | ({"gamma": gamma} if gamma is not None else {}) | {"n": 5}


def draft_raw(a_ms: float = 1.0, b_ms: float = 0.5, per_row: float = 0.1) -> dict[str, Any]:
    """A draft profile with S(B, g) = (a + (g - 1) b)(1 + per_row (B - 1)) exactly."""
    grid = {
        "service_ms": [
            cell((a_ms + (g - 1) * b_ms) * (1 + per_row * (b - 1)), b, g)
            for g in GAMMAS
            for b in BATCHES
        ]
    }
    return profile.new_profile("draft", {"name": "d"}, profile.machine_info("cpu", "float32"), grid)


def target_raw(step_ms: float = 6.0, per_pos: float = 0.05, name: str = "t") -> dict[str, Any]:
    """A target profile with V(B, g) = T(1)(1 + per_pos (B (g + 1) - 1))."""

    def v(b: int, g: int) -> float:
        return step_ms * (1 + per_pos * (b * (g + 1) - 1))

    grid = {
        "step_ms": [cell(v(b, 0), b) for b in BATCHES],
        "verify_ms": [cell(v(b, g), b, g) for g in GAMMAS for b in BATCHES],
    }
    machine = profile.machine_info("cpu", "float32")
    return profile.new_profile("target", {"name": name}, machine, grid)


def write(tmp_path: Path, name: str, raw: dict[str, Any]) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return str(path)


def make_plan(tmp_path: Path, targets: list[str] | None = None, **kw: Any) -> planning.Plan:
    draft = write(tmp_path, "d.json", draft_raw())
    targets = targets or [write(tmp_path, "t.json", target_raw()) + ":10"]
    return plan_report.build_plan(plan_report.PlanRequest(draft, tuple(targets), **kw))


# ---------------------------------------------------------------------------------- schema


def test_schema_round_trip(tmp_path: Path) -> None:
    """A profile written is read back field for field (catches a writer and a reader that drift
    apart, and the compact JSON layout losing or reordering values)."""
    raw = draft_raw()
    path = profile.write_profile(raw, tmp_path / "sub" / "d.json")
    loaded = profile.load_profile(path, "draft")
    assert loaded.raw == raw and loaded.kind == "draft" and loaded.source == "measured"
    assert json.loads(profile.dumps(raw)) == raw
    assert loaded.seconds("service_ms")[(2, 4)] == pytest.approx((1.0 + 3 * 0.5) * 1.1 / 1e3)


def test_summary_and_alternation() -> None:
    """Median and spread come from the repeats, and odd repeats run the cells backwards
    (catches a p10/p90 mix-up and a fixed order that lets the machine's drift bias one cell)."""
    s = profile.summary([0.001 * i for i in range(1, 12)])
    assert s["median_ms"] == pytest.approx(6.0) and s["n"] == 11
    assert s["p10_ms"] == pytest.approx(2.0) and s["p90_ms"] == pytest.approx(10.0)
    assert list(profile.alternated([1, 2, 3], 0)) == [1, 2, 3]
    assert list(profile.alternated([1, 2, 3], 1)) == [3, 2, 1]


def _mutate(raw: dict[str, Any], where: str, value: Any) -> dict[str, Any]:
    """``raw`` with ``where`` (dotted, list indices allowed) set to ``value`` (DELETE: removed)."""
    raw = json.loads(json.dumps(raw))
    *path, last = where.split(".")
    node: Any = raw
    for key in path:
        node = node[int(key)] if key.isdigit() else node[key]
    if value == "DELETE":
        del node[int(last) if last.isdigit() else last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return raw


BAD = [
    ("schema_version", 2, "schema_version"),
    ("protocol_version", 1, "protocol_version"),
    ("machine", "DELETE", "machine"),
    ("kind", "hub", "kind"),
    ("grid.service_ms.3.median_ms", -1.0, "grid.service_ms[3].median_ms"),
    ("grid.service_ms.3.median_ms", float("nan"), "grid.service_ms[3].median_ms"),
    ("grid.service_ms.3.p90_ms", float("inf"), "grid.service_ms[3].p90_ms"),
    ("grid.service_ms.3.median_ms", "DELETE", "grid.service_ms[3]: median_ms"),
    ("grid.service_ms.5", "DELETE", "grid.service_ms: batch 2 lacks gamma [2]"),
    ("grid.service_ms.2.batch", 0, "grid.service_ms[2].batch"),
    ("grid.service_ms.2.batch", "DELETE", "grid.service_ms[2]: batch"),
]


@pytest.mark.parametrize(("where", "value", "field"), BAD)
def test_bad_profile_names_file_and_field(
    tmp_path: Path, where: str, value: Any, field: str
) -> None:
    """Each unusable profile is refused with the file and the field in one line (catches a bad
    profile planned with silently, or an error that leaves the user hunting for the cause)."""
    path = write(tmp_path, "bad.json", _mutate(draft_raw(), where, value))
    with pytest.raises(ProfileError) as exc:
        profile.load_profile(path, "draft")
    message = str(exc.value)
    assert message.startswith(path) and field in message and "\n" not in message


def test_target_without_batch_one_and_wrong_kind(tmp_path: Path) -> None:
    """A target profile lacking B = 1, or a target given as the draft, is refused (catches T(1)
    guessed from a batch of 2, and a swapped --draft/--target)."""
    raw = target_raw()
    raw["grid"]["step_ms"] = [c for c in raw["grid"]["step_ms"] if c["batch"] != 1]
    with pytest.raises(ProfileError, match=r"grid\.step_ms: no batch 1"):
        profile.load_profile(write(tmp_path, "t.json", raw))
    with pytest.raises(ProfileError, match=r"t2\.json: kind: 'target'"):
        profile.load_profile(write(tmp_path, "t2.json", target_raw()), "draft")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ProfileError, match=r"x\.json: not JSON"):
        profile.load_profile(tmp_path / "x.json")


def test_cli_exits_2_with_the_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``starsd plan`` on a bad file exits 2 with one line naming it (catches a traceback or
    exit 1 that scripts cannot tell from a failed measurement)."""
    draft = write(tmp_path, "d.json", _mutate(draft_raw(), "schema_version", 9))
    target = write(tmp_path, "t.json", target_raw())
    assert cli.main(["plan", "--draft", draft, "--target", target]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("starsd: error: ") and draft in err and "schema_version" in err


def test_fingerprint_mismatch(tmp_path: Path, llama_pair: tuple[Path, Path]) -> None:
    """A profile checked against another model's directory is refused (catches planning a fleet
    on the costs of a different model)."""
    target_dir, draft_dir = llama_pair
    raw = draft_raw()
    raw["model"]["fingerprint"] = profile.model_fingerprint(draft_dir)
    loaded = profile.check_profile(raw, "d.json")
    profile.check_fingerprint(loaded, draft_dir)
    with pytest.raises(ProfileError, match=r"d\.json: model\.fingerprint\.id"):
        profile.check_fingerprint(loaded, target_dir)
    fp = profile.model_fingerprint(target_dir)
    assert fp["parameters"] and fp["parameters"] > raw["model"]["fingerprint"]["parameters"]
    published = REPO / "profiles/published-h100-llama31-8b-target.json"
    with pytest.raises(ProfileError, match=r"model\.fingerprint\.id: None"):
        profile.check_fingerprint(profile.load_profile(published), target_dir)


@pytest.mark.parametrize(
    "content",
    [{"alpha": 1.5}, {"mean_accepted": "x", "gamma": 4}, {"mean_accepted": 5, "gamma": 4}, {}],
)
def test_bad_acceptance_file(tmp_path: Path, content: dict[str, Any]) -> None:
    """An acceptance file without a usable alpha is refused naming it (catches a traceback, or
    an alpha outside [0, 1] planned with)."""
    path = write(tmp_path, "acc.json", content)
    with pytest.raises(ProfileError, match=r"acc\.json: (alpha|mean_accepted)"):
        planning.alpha_from_file(path)


# ---------------------------------------------------------------------------------- the plan


def test_fit_recovers_the_service_model() -> None:
    """S(B, g) = a(B) + (g - 1) b(B) is recovered from a grid that follows it, and one gamma gives
    the analytic model's own proportional curve (catches a curve that is not the hub's model)."""
    curve = planning.service_curve(profile.check_profile(draft_raw(), "d"))
    for b in BATCHES:
        for g in (1, 3, 8, 12):
            want = (1.0 + (g - 1) * 0.5) * (1 + 0.1 * (b - 1)) / 1e3
            assert curve.at(b, g) == pytest.approx(want)
    one = draft_raw()
    one["grid"]["service_ms"] = [c for c in one["grid"]["service_ms"] if c["gamma"] == 4]
    single = planning.service_curve(profile.check_profile(one, "d"))
    points = [(b, (1.0 + 1.5) * (1 + 0.1 * (b - 1)) / 1e3) for b in BATCHES]
    assert single == ServiceCurve.proportional(points, 4)


@pytest.mark.parametrize("gamma", [None, 2])
def test_plan_is_the_analytic_model(tmp_path: Path, gamma: int | None) -> None:
    """Every row equals starsd.analytic for inputs built from the profiles by hand (catches a
    second model creeping into the planner, and inputs read from the wrong cells)."""
    plan = make_plan(tmp_path, gamma=gamma, alpha=0.75, link_ms=0.4, max_batch=16, tree="off")
    (kind,) = plan.kinds
    assert kind.inputs.gamma == 4  # the hub's starting gamma, measured in both
    curve = planning.service_curve(plan.draft)
    t1, v14 = 6.0 / 1e3, 6.0 * (1 + 0.05 * (1 * (4 + 1) - 1)) / 1e3  # as the cells hold them
    inputs = analytic.ModelInputs(0.75, 4, curve.at(1, 4), v14, 0.4e-3, t1, 16, curve)
    # V(1, g) = 6 (1 + 0.05 g) ms: 0.3 ms more per draft token
    assert kind.inputs.verify_per_token_s == pytest.approx(0.3e-3, rel=1e-9)
    inputs = dataclasses.replace(
        inputs, verify_per_token_s=kind.inputs.verify_per_token_s, messages_share_drafter=True
    )  # a CPU draft profile: its drafter takes turns with the message path (free here)
    assert kind.inputs == inputs
    for row in planning.rows(plan, planning.sweep(64)):
        n = row["n"]
        if gamma is None:
            g, p = analytic.auto_gamma(inputs, n, 8)
        else:
            g, p = gamma, analytic.predict(analytic.at_gamma(inputs, gamma), n)
        assert row["gamma"] == g
        assert row["per_target_tokens_per_s"] == p.per_target_tokens_per_s
        assert row["system_tokens_per_s"] == pytest.approx(p.system_tokens_per_s, rel=1e-12)
        assert row["regime"] == p.regime


def test_planner_gamma_is_the_hubs_rule(tmp_path: Path) -> None:
    """At N = 1 (under-loaded) the planner's gamma is starsd.goodput.best_gamma on the profile's
    costs (catches a planner that picks gamma by a rule the hub does not use)."""
    plan = make_plan(tmp_path, alpha=0.8, link_ms=0.2, tree="off")
    (kind,) = plan.kinds
    i = kind.inputs
    expected = [analytic.expected_tokens_per_round(0.8, g) for g in range(9)]
    outside = [i.verify_s + (g - 4) * i.verify_per_token_s + i.link_s for g in range(9)]
    want = goodput.best_gamma(expected, i.curve.costs(1, 8), outside, i.target_step_s, 1, False)
    (row,) = planning.rows(plan, [1])
    assert row["gamma"] == want and row["regime"] == "under-loaded"


def test_the_plans_tree_is_the_models_and_the_hubs_rule_picks_it(tmp_path: Path) -> None:
    """A target whose verification costs no more for 8 nodes than for 4 (per_pos 0: a GPU's
    shape) gets the hub's 8-node tree while the hub idles, with exactly the model's prediction
    for the tree's inputs built by hand (catches a second model, a tree verified at the chain's
    cost, E[L] of another tree); chains once the hub is fully loaded, and chains throughout
    when the verification grows with the nodes (this CPU's shape) or under --tree off."""
    flat = write(tmp_path, "flat.json", target_raw(per_pos=0.0)) + ":10"
    plan = make_plan(tmp_path, [flat], alpha=0.7, link_ms=0.2, max_batch=1)
    assert [planning.shape_name(t) for t in plan.trees] == ["tree 2x4/8", "tree 2x3/4"]
    (kind,) = plan.kinds
    _, parents = ranked_tree(TreeShape(2, 4, 8))
    tokens = analytic.expected_tree_tokens(0.7, analytic.SIBLING_ALPHA, parents)
    by_hand = dataclasses.replace(
        kind.inputs, tree=analytic.TreeRound(2, 4, tokens), verify_s=kind.inputs.target_step_s
    )
    full = planning.kind_sizing(plan, kind)["n_full"]
    assert full is not None
    one, many = planning.rows(plan, [1, full])
    assert one["shape"] == "tree 2x4/8"
    want = analytic.predict(by_hand, 1).per_target_tokens_per_s
    assert one["per_target_tokens_per_s"] == pytest.approx(want, rel=1e-12)
    chain = analytic.auto_gamma(kind.inputs, 1, plan.max_gamma)[1]
    assert want > chain.per_target_tokens_per_s
    assert many["shape"] == "chain" and many["regime"] == "fully-loaded"
    mild = make_plan(tmp_path, [write(tmp_path, "m.json", target_raw(per_pos=0.05)) + ":1"])
    tree_verify = planning.tree_inputs(mild, mild.kinds[0], TreeShape(2, 4, 8)).verify_s
    assert tree_verify == pytest.approx(6.0 * (1 + 0.05 * 8) / 1e3)  # V(1, 8): 8 nodes, 9 rows
    steep = make_plan(tmp_path, [write(tmp_path, "s.json", target_raw(per_pos=0.2)) + ":1"])
    steep_shapes = {r["shape"] for r in planning.rows(steep, planning.sweep(64))}
    assert "chain" in steep_shapes and steep_shapes <= {"chain", "alone"}
    off = make_plan(tmp_path, [flat], alpha=0.7, link_ms=0.2, tree="off")
    assert {r["shape"] for r in planning.rows(off, [1, 8])} == {"chain"}


def test_sizing_at_a_fixed_gamma_is_the_saturation_point(tmp_path: Path) -> None:
    """With a fixed gamma, N_full is analytic.saturation_point and the hub count is the ceiling
    of the fleet over min(N_full, break-even) (catches an off-by-one in either scan)."""
    plan = make_plan(tmp_path, gamma=2, alpha=0.9, max_batch=8)
    s = planning.sizing(plan)
    at = analytic.at_gamma(plan.kinds[0].inputs, 2)
    assert s["n_full"] == analytic.saturation_point(at)
    assert s["break_even_n"] == analytic.break_even_targets(at)
    assert s["hubs"] == math.ceil(10 / min(s["n_full"], s["break_even_n"]))


def test_the_hubs_message_path_bounds_the_targets_a_hub_takes(tmp_path: Path) -> None:
    """With --hub-rounds-per-s, N_hub is also the last N whose rounds a second (N over the
    iteration) stay within it (catches the bound ignored, off by one, or applied without it);
    a rate that is not > 0 is refused."""
    plan = make_plan(tmp_path, gamma=2, alpha=0.9, max_batch=8)
    free = planning.sizing(plan)
    assert free["message_bound_n"] is None and free["hub_rounds_per_s"] is None
    at = analytic.at_gamma(plan.kinds[0].inputs, 2)
    rate2, rate3 = (n / analytic.predict(at, n).iteration_s for n in (2, 3))
    cap = (rate2 + rate3) / 2  # 2 targets fit, 3 do not
    bound = planning.sizing(dataclasses.replace(plan, hub_rounds_per_s=cap))
    assert bound["message_bound_n"] == 2 and bound["targets_per_hub"] == 2
    assert bound["hubs"] == math.ceil(plan.fleet / 2)
    req = plan_report.PlanRequest(plan.draft.path, (plan.kinds[0].profile.path,))
    with pytest.raises(ProfileError, match="hub-rounds-per-s"):
        plan_report.build_plan(dataclasses.replace(req, hub_rounds_per_s=0.0))
    assert "message bound 2" in "\n".join(
        plan_report.sizing_lines(dataclasses.replace(plan, hub_rounds_per_s=cap))
    )


def test_the_hubs_message_path_delays_every_batch(tmp_path: Path) -> None:
    """With --hub-rounds-per-s R the model's per_message_s is 1 / R (a batch's last job
    arrives (B - 1) / R after its first), so the plan predicts less for many targets; catches
    the rate used only as the sizing bound, or its inverse taken wrong."""
    plan = make_plan(tmp_path, gamma=2, alpha=0.9, max_batch=8)
    req = plan_report.PlanRequest(plan.draft.path, (plan.kinds[0].profile.path,), gamma=2)
    bounded = plan_report.build_plan(dataclasses.replace(req, hub_rounds_per_s=2000.0))
    free = plan_report.build_plan(req)
    assert bounded.kinds[0].inputs.per_message_s == pytest.approx(1 / 2000)
    assert free.kinds[0].inputs.per_message_s == 0.0
    slow, fast = (planning.rows(p, [8])[0]["system_tokens_per_s"] for p in (bounded, free))
    assert slow < fast
    assert "0.5000 ms of it a round" in "\n".join(plan_report.header(bounded, 8))
    assert "taken as free" in "\n".join(plan_report.header(free, 8))


def test_a_cpu_drafters_plan_charges_it_the_message_path(tmp_path: Path) -> None:
    """A draft profile measured on a CPU plans its batches at S(B) + B / R (the hub's event
    loop takes turns with the drafter), one measured on a GPU at S(B); catches the term keyed
    on the target's device, applied to a GPU drafter, or left out of the plan."""
    cpu = write(tmp_path, "cpu.json", draft_raw())
    gpu_raw = draft_raw()
    gpu_raw["machine"]["device"] = "cuda"
    gpu = write(tmp_path, "gpu.json", gpu_raw)
    target = write(tmp_path, "t.json", target_raw())
    made = {
        name: plan_report.build_plan(
            plan_report.PlanRequest(path, (target,), gamma=2, max_batch=8, hub_rounds_per_s=2e3)
        )
        for name, path in (("cpu", cpu), ("gpu", gpu))
    }
    on_cpu, on_gpu = (made[k].kinds[0].inputs for k in ("cpu", "gpu"))
    assert on_cpu.messages_share_drafter and not on_gpu.messages_share_drafter
    assert analytic.service_s(on_cpu, 8) == pytest.approx(analytic.service_s(on_gpu, 8) + 8 / 2e3)
    slow, fast = (planning.rows(made[k], [64])[0]["system_tokens_per_s"] for k in ("cpu", "gpu"))
    assert slow < fast
    assert "takes turns" in "\n".join(plan_report.header(made["cpu"], 8))


def test_mixed_fleet(tmp_path: Path) -> None:
    """Two target kinds share one hub: each kind's row is its own analytic prediction at N, the
    fleet row sums the kinds by their share, and N_hub is the tightest kind's (catches a mixed
    fleet planned as its first kind alone, or shares that do not add up)."""
    fast = write(tmp_path, "fast.json", target_raw(4.0, 0.01, "fast")) + ":30"
    slow = write(tmp_path, "slow.json", target_raw(40.0, 0.02, "slow")) + ":10"
    plan = make_plan(tmp_path, [fast, slow], alpha=0.7, link_ms=1.0)
    assert plan.fleet == 40
    rows = planning.rows(plan, [8])
    by = {r["kind"]: r for r in rows}
    assert set(by) == {"fast", "slow", "fleet"}
    for kind, share in zip(plan.kinds, (0.75, 0.25), strict=True):
        g, p = analytic.auto_gamma(kind.inputs, 8, plan.max_gamma)
        assert by[kind.profile.name]["gamma"] == g
        assert by[kind.profile.name]["system_tokens_per_s"] == pytest.approx(
            share * p.system_tokens_per_s
        )
    total = by["fast"]["system_tokens_per_s"] + by["slow"]["system_tokens_per_s"]
    assert by["fleet"]["system_tokens_per_s"] == pytest.approx(total)
    s = planning.sizing(plan)
    tightest = min(min(k["n_full"] or 10**9, k["break_even_n"]) for k in s["kinds"].values())
    assert s["targets_per_hub"] == tightest and s["hubs"] == math.ceil(40 / tightest)
    plan_report.plot(plan, [1, 8, 64], str(tmp_path / "plan.png"))
    assert (tmp_path / "plan.png").stat().st_size > 0


def test_plot_without_a_saturation_point(tmp_path: Path) -> None:
    """A plan whose hub never fills (speculation turns off first) still plots (catches a
    vertical N_full line drawn at None)."""
    slow_hub = write(tmp_path, "d.json", draft_raw(a_ms=30.0, b_ms=30.0))
    target = write(tmp_path, "t.json", target_raw())
    plan = plan_report.build_plan(plan_report.PlanRequest(slow_hub, (target,)))
    assert planning.sizing(plan)["n_full"] is None
    plan_report.plot(plan, [1, 2], str(tmp_path / "plan.png"))


def test_gaps_are_said_and_a_missing_gamma_refused(tmp_path: Path) -> None:
    """Batch sizes the sweep reads but nobody measured are named in the output, and a target
    without a gamma the draft measured is refused naming both files (catches interpolation
    passed off as measurement)."""
    plan = make_plan(tmp_path, max_batch=32)
    text = plan_report.report(plan, planning.sweep(32))
    assert "interpolated (linear in B) at 3, 5..7" in text and "extrapolated at 9..32" in text
    odd = target_raw()
    odd["grid"]["verify_ms"] = [dict(c, gamma=c["gamma"] + 10) for c in odd["grid"]["verify_ms"]]
    bad = write(tmp_path, "odd.json", odd)
    with pytest.raises(ProfileError, match=r"odd\.json: grid\.verify_ms: no gamma in common"):
        make_plan(tmp_path, [bad])


def test_shipped_profiles_load_and_plan(tmp_path: Path) -> None:
    """Every profile under profiles/ validates, and the published H100 pair plans with the
    published acceptance (catches a shipped file that the reader refuses)."""
    paths = sorted((REPO / "profiles").glob("*.json"))
    kinds = {p.name: profile.load_profile(p).source for p in paths if "acceptance" not in p.name}
    assert "published" in kinds.values() and "measured" in kinds.values()
    req = plan_report.PlanRequest(
        str(REPO / "profiles/published-h100-llama31-8b-eagle3-draft.json"),
        (str(REPO / "profiles/published-h100-llama31-8b-target.json") + ":100",),
        acceptance=str(REPO / "profiles/published-llama31-8b-eagle3-acceptance.json"),
    )
    plan = plan_report.build_plan(req)
    (row,) = planning.rows(plan, [1])
    assert row["speedup_vs_alone"] > 2.0  # the cited 2.36x at batch 1, give or take gamma
    plan_report.write_json(plan, [1, 4], str(tmp_path / "plan.json"))
    assert json.loads((tmp_path / "plan.json").read_text())["sizing"]["hubs"] >= 1


# ---------------------------------------------------------------------------------- measuring


def test_profile_draft_and_target_on_tiny_models(
    tmp_path: Path, llama_pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """``starsd profile draft`` and ``target`` on tiny models write valid profiles of those
    models, ``profile check --model`` accepts them and refuses the other model (catches a
    measuring path that drifted from the hub's proposer or the verifier's backend)."""
    target_dir, draft_dir = llama_pair
    grid = ["--batch", "1,2", "--gammas", "2", "--repeats", "1", "--context", "8"]
    d, t = str(tmp_path / "d.json"), str(tmp_path / "t.json")
    assert cli.main(["profile", "draft", "--model", str(draft_dir), *grid, "--out", d]) == 0
    assert cli.main(["profile", "target", "--model", str(target_dir), *grid, "--out", t]) == 0
    draft, target = profile.load_profile(d, "draft"), profile.load_profile(t, "target")
    assert set(draft.seconds("service_ms")) == {(1, 2), (2, 2)}
    assert set(target.seconds("verify_ms")) == {(1, 2), (2, 2)}
    assert target.raw["machine"]["torch_threads"] == 1
    assert cli.main(["profile", "check", d, "--model", str(draft_dir)]) == 0
    assert cli.main(["profile", "check", d, "--model", str(target_dir)]) == 2
    assert cli.main(["plan", "--draft", d, "--target", t, "--max-n", "4"]) == 0
    assert "| 4 |" in capsys.readouterr().out
    raw = profile.load_profile(t).raw
    assert profile_cli.default_out(raw) == f"profiles/target-{target_dir.name}-cpu.json"


async def test_profile_link_against_a_hub(running_hub: Any) -> None:
    """PING/PONG against a hub on a random loopback port yields a valid link profile (catches a
    probe that needs a session, or times that are not round trips)."""
    from edge.profile import link_profile, probe_link

    rtts, connects = await probe_link(running_hub.endpoint, 3, None, 5.0, lambda _: None)
    assert len(rtts) == len(connects) == 3 and all(0 < r < 1 for r in rtts)
    raw = link_profile(running_hub.endpoint, rtts, connects, False, 0.1)
    assert profile.check_profile(raw, "link").seconds("round_trip_ms")[(1, 0)] > 0


def test_planner_constants_are_the_hubs() -> None:
    """The planner's default M, starting gamma and tree are the hub's (catches a hub default
    changed without the planner, which would then plan another hub)."""
    from starsd.hub.config import AUTO_START_GAMMA, HubConfig

    assert HubConfig.__dataclass_fields__["max_batch"].default == planning.HUB_MAX_BATCH
    assert planning.HUB_START_GAMMA == AUTO_START_GAMMA
    tree = (HubConfig.tree_width, HubConfig.tree_depth, HubConfig.tree_nodes)
    assert tree == (planning.HUB_TREE.width, planning.HUB_TREE.depth, planning.HUB_TREE.nodes)


def test_the_starsd_command_stays_light() -> None:
    """Importing the ``starsd`` command loads neither torch nor the hub (catches a measuring
    module imported at the top, which would make ``starsd keys`` and ``starsd plan`` slow)."""
    from test_imports import modules_after_import

    _, loaded = modules_after_import("starsd.cli")
    assert "torch" not in loaded and not [m for m in loaded if m.startswith(("starsd.hub", "edge"))]


# ---------------------------------------------------------------------------------- replay


def test_interpolate_between_and_beyond() -> None:
    """V(1, g) between and beyond the measured gammas (catches a replay that drops to the first
    point, or extrapolates below the last one measured)."""
    pts = ((1, 2.0), (2, 3.0), (4, 7.0))
    assert profile.interpolate(pts, 3) == pytest.approx(5.0)
    assert profile.interpolate(pts, 6) == pytest.approx(11.0)
    assert profile.interpolate(pts, 0) == pytest.approx(2.0)
    assert profile.interpolate(((1, 4.0), (2, 3.0)), 5) == pytest.approx(3.0)


def test_emulated_proposer_takes_the_profiles_time(tmp_path: Path) -> None:
    """The emulated drafter's call for B jobs of g tokens lasts S(B, g) of its profile (catches a
    replay that sleeps per job, or at the wrong gamma)."""
    from starsd.hub.drafters.emulated import EmulatedProposer
    from starsd.hub.synthetic import FakeSessions

    path = write(tmp_path, "d.json", draft_raw(a_ms=8.0, b_ms=4.0, per_row=0.5))
    proposer = EmulatedProposer.from_profile(path)
    sessions = FakeSessions(proposer, 100, gamma=3)
    pool = sessions.open(4, 8)
    want = (8.0 + 2 * 4.0) * (1 + 0.5 * 3) / 1e3  # S(4, 3)
    took = min(sessions.propose(pool) for _ in range(3))
    assert want <= took < want + 0.03
    with pytest.raises(ValueError, match="emulated"):
        from starsd.hub.config import HubConfig

        HubConfig(model="m", draft_kind="emulated")


async def test_a_hub_drafts_under_a_profile(tmp_path: Path, llama_pair: tuple[Path, Path]) -> None:
    """A hub started with --draft-kind emulated answers OPEN with a proposal of the asked gamma,
    its tokenizer taken from --model without weights (catches an emulated hub that cannot
    serve a real target)."""
    import asyncio

    from conftest import RawTarget

    from starsd import hub as hub_module
    from starsd import models, transport

    path = write(tmp_path, "d.json", draft_raw(a_ms=1.0, b_ms=0.5))
    config = hub_module.HubConfig(
        model=str(llama_pair[1]),
        bind="tcp://127.0.0.1:*",
        stats_interval=3600,
        draft_kind="emulated",
        draft_profile=path,
    )
    hub = hub_module.build_hub(config)
    ctx = transport.new_context()
    task = asyncio.create_task(hub.serve(ctx))
    while not hub.endpoint:
        await asyncio.sleep(0.01)
    target = RawTarget(hub.endpoint)
    try:
        welcome = await target.hello(models.load_causal_lm(llama_pair[0]))
        assert welcome.draft_kind == "emulated"
        _, proposal = await target.open()
        assert len(proposal.tokens) == 4
    finally:
        target.close()
        hub.stop()
        await asyncio.wait_for(task, 10)
        ctx.term()


def test_emulated_targets_follow_a_target_profile(tmp_path: Path) -> None:
    """``scripts.emulate.emulated --profile`` verifies at V(1, g) and decodes alone at T(1), and
    the scale suite passes both profiles on (catches a replay that keeps --verify-ms)."""
    from scripts.bench import scale
    from scripts.bench.common import BenchConfig
    from scripts.emulate import emulated

    path = write(tmp_path, "t.json", target_raw(step_ms=10.0, per_pos=0.1))
    cfg = emulated.parse_args(["--hub", "tcp://127.0.0.1:1", "--profile", path])
    assert cfg.verify_s(4) == pytest.approx(10.0 * 1.4 / 1e3)
    assert cfg.verify_s(3) == pytest.approx(10.0 * 1.3 / 1e3)  # between 2 and 4
    assert cfg.step_alone_s == pytest.approx(10.0 / 1e3)
    bench = BenchConfig("scale", "t", "d", draft_profile="D.json", target_profile=path)
    assert scale.replayed(bench) == ["--draft-kind", "emulated", "--draft-profile", "D.json"]
