"""``starsd profile`` and ``starsd plan``: measure a model's costs, then plan a fleet from them.

    starsd profile draft --model DIR [--draft-kind llm|eagle|eagle3 --target DIR] --out D.json
    starsd profile target --model DIR --out T.json
    starsd profile link --hub tcp://host:port --out L.json
    starsd profile check FILE [--model DIR]
    starsd plan --draft D.json --target T.json[:COUNT] [...] [--link L.json | --link-ms X]
        [--hub-rounds-per-s R]

The measuring code is imported inside each subcommand (torch only where a model is timed), so
``starsd keys`` and ``starsd plan`` stay light. See docs/planning.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from starsd.analytic import SIBLING_ALPHA
from starsd.plan import HUB_MAX_BATCH, HUB_TREE
from starsd.profile import ProfileError
from starsd.tree_shapes import TreeShape

DEFAULT_BATCHES = "1,2,4,8,16"
DEFAULT_GAMMAS = "1,2,4,8"


def int_list(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4] (sorted, distinct, each >= 1)."""
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"want integers like 1,2,4, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"want integers >= 1, got {text!r}")
    return values


def add_parsers(commands: Any) -> None:
    """Add ``profile`` and ``plan`` to the ``starsd`` subcommands."""
    profile = commands.add_parser(
        "profile",
        help="measure S(B, g), T(B), V(B, g) or the link",
        description="Measure a model's costs on this machine into a profile JSON "
        "(docs/planning.md). Each cell: median, p10, p90 over --repeats, the order alternated.",
    )
    kinds = profile.add_subparsers(dest="kind", required=True, metavar="KIND")
    _draft_parser(kinds)
    _target_parser(kinds)
    _link_parser(kinds)
    check = kinds.add_parser("check", help="validate a profile (and its model, with --model)")
    check.add_argument("path", help="a profile JSON")
    check.add_argument("--model", help="the model directory it must have been made of")
    _plan_parser(commands)


def _grid_args(p: argparse.ArgumentParser, repeats: int) -> None:
    p.add_argument("--model", required=True, help="the model directory")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--batch", type=int_list, default=DEFAULT_BATCHES, help="batch sizes B")
    p.add_argument("--gammas", type=int_list, default=DEFAULT_GAMMAS, help="draft lengths g")
    p.add_argument("--repeats", type=int, default=repeats, help="timed passes over the grid")
    p.add_argument("--context", type=int, default=128, help="cached context tokens per row")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the hub's default 1)")
    p.add_argument(
        "--out", help="the profile JSON to write (default: profiles/KIND-MODEL-DEVICE.json)"
    )


def _draft_parser(kinds: Any) -> None:
    p = kinds.add_parser("draft", help="S(B, g): the hub's proposer on B sessions at once")
    _grid_args(p, repeats=21)
    p.add_argument("--draft-kind", default="llm", choices=("llm", "eagle", "eagle3"))
    p.add_argument("--target", help="eagle/eagle3: the target's directory")


def _target_parser(kinds: Any) -> None:
    p = kinds.add_parser("target", help="T(B) and V(B, g): the target's forwards")
    _grid_args(p, repeats=21)


def _link_parser(kinds: Any) -> None:
    p = kinds.add_parser("link", help="the PING/PONG round trip to a running hub")
    p.add_argument("--hub", required=True, help="the hub's endpoint, e.g. tcp://10.0.0.2:5555")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a PONG")
    p.add_argument("--curve-secret", help="this target's NAME.key_secret (CURVE hubs)")
    p.add_argument("--hub-public-key", help="the hub's hub.key (CURVE hubs)")
    p.add_argument("--out", help="the profile JSON to write (default: profiles/link-HOST.json)")


def _plan_parser(commands: Any) -> None:
    p = commands.add_parser(
        "plan",
        help="throughput against N targets per hub, and the hubs a fleet needs",
        description="The analytic model (starsd.analytic) with its inputs read from profiles, "
        "gamma chosen by the hub's own rule (starsd.goodput). Hubs needed = ceil(fleet / "
        "N_hub), N_hub = min(N_full, break-even N) over the target kinds (docs/planning.md).",
    )
    p.add_argument("--draft", required=True, help="a draft profile")
    p.add_argument(
        "--target",
        required=True,
        action="append",
        help="a target profile, FILE[:COUNT] (COUNT targets of this kind in the fleet, "
        "default 1); repeat for a mixed fleet",
    )
    link = p.add_mutually_exclusive_group()
    link.add_argument("--link", help="a link profile (its median round trip)")
    link.add_argument("--link-ms", type=float, help="the link's round trip in ms")
    acc = p.add_mutually_exclusive_group()
    acc.add_argument("--alpha", type=float, default=0.7, help="per-token acceptance rate")
    acc.add_argument("--acceptance", help='a JSON with "alpha", or "mean_accepted" and "gamma"')
    p.add_argument("--max-n", type=int, default=256, help="largest N (targets per hub)")
    p.add_argument("--max-batch", type=int, default=HUB_MAX_BATCH, help="the hub's --max-batch M")
    p.add_argument("--gamma", default="auto", help="auto (the hub's rule) or a fixed gamma")
    p.add_argument("--max-gamma", type=int, help="auto's largest gamma (default: measured)")
    p.add_argument("--tree", default="auto", choices=("auto", "off"), help="the hub's --tree")
    p.add_argument("--tree-width", type=int, default=HUB_TREE.width, help="the hub's --tree-width")
    p.add_argument("--tree-depth", type=int, default=HUB_TREE.depth, help="the hub's --tree-depth")
    p.add_argument("--tree-nodes", type=int, default=HUB_TREE.nodes, help="the hub's --tree-nodes")
    p.add_argument(
        "--sibling-alpha",
        type=float,
        default=SIBLING_ALPHA,
        help="a tree node's later children: the chance each holds the token the ones before "
        "missed (default fitted to the real pair's trees)",
    )
    p.add_argument(
        "--hub-rounds-per-s",
        type=float,
        help="rounds a second the hub's message path carries (python -m scripts.bench.hub_flood "
        "on the hub's machine); N_hub then also stays within it (default: unbounded)",
    )
    p.add_argument("--draft-model", help="check the draft profile was made of this model")
    p.add_argument("--plot", help="write the curves to this PNG")
    p.add_argument("--json", help="write the plan to this JSON")


# ---------------------------------------------------------------------------------- running


def run(ns: argparse.Namespace) -> int:
    """Run ``profile`` or ``plan``; ProfileError (bad input) -> exit 2 with one line."""
    try:
        if ns.command == "plan":
            return _plan(ns)
        return {"draft": _draft, "target": _target, "link": _link, "check": _check}[ns.kind](ns)
    except ProfileError as exc:
        print(f"starsd: error: {exc}", file=sys.stderr)
        return 2


def _draft(ns: argparse.Namespace) -> int:
    import torch

    from starsd.hub.config import HubConfig
    from starsd.hub.profile import measure_draft
    from starsd.profile import write_profile

    torch.set_num_threads(ns.threads)
    config = HubConfig(
        model=ns.model, device=ns.device, dtype=ns.dtype, draft_kind=ns.draft_kind, target=ns.target
    )
    raw = measure_draft(config, ns.batch, ns.gammas, ns.repeats, ns.context)
    return _written(write_profile(raw, ns.out or default_out(raw)), raw)


def _target(ns: argparse.Namespace) -> int:
    import torch

    from edge.profile import measure_target
    from starsd.profile import write_profile

    torch.set_num_threads(ns.threads)
    raw = measure_target(ns.model, ns.device, ns.dtype, ns.batch, ns.gammas, ns.repeats, ns.context)
    return _written(write_profile(raw, ns.out or default_out(raw)), raw)


def _link(ns: argparse.Namespace) -> int:
    from edge.profile import curve_config, measure_link
    from starsd.profile import write_profile

    try:
        curve = curve_config(ns.curve_secret, ns.hub_public_key)
        raw = measure_link(ns.hub, ns.repeats, curve, ns.timeout)
    except (ValueError, TimeoutError, OSError) as exc:
        print(f"starsd: error: {ns.hub}: {exc}", file=sys.stderr)
        return 1
    return _written(write_profile(raw, ns.out or default_out(raw)), raw)


def default_out(raw: dict[str, Any]) -> str:
    """profiles/KIND-MODEL-DEVICE.json (a link: profiles/link-HOST_PORT.json)."""
    if raw["kind"] == "link":
        where = raw["model"]["endpoint"].split("://")[-1]
    else:
        where = f"{raw['model']['name']}-{raw['machine']['device']}"
    safe = "".join(c if c.isalnum() or c in "-." else "_" for c in where)
    return f"profiles/{raw['kind']}-{safe}.json"


def _written(path: Any, raw: dict[str, Any]) -> int:
    print(f"wrote {path} ({raw['kind']}, {raw.get('wall_s', 0):.1f} s)")
    for name, cells in raw["grid"].items():
        if isinstance(cells, list):
            text = ", ".join(_cell(c) for c in cells)
            print(f"  {name}: {text}")
        elif isinstance(cells, dict):
            print(f"  {name}: {_cell(cells)}")
    return 0


def _cell(c: dict[str, Any]) -> str:
    where = f"B{c.get('batch', 1)}" + (f"g{c['gamma']}" if "gamma" in c else "")
    return f"{where} {c['median_ms']:.3f} ms"


def _check(ns: argparse.Namespace) -> int:
    from starsd.profile import check_fingerprint, load_profile

    profile = load_profile(ns.path)
    if ns.model:
        check_fingerprint(profile, ns.model)
    print(f"{ns.path}: a valid {profile.source} {profile.kind} profile of {profile.name}")
    return 0


def _plan(ns: argparse.Namespace) -> int:
    from starsd import plan as planning
    from starsd import plan_report

    if ns.max_n < 1 or ns.max_batch < 1:
        raise ProfileError("--max-n and --max-batch must be >= 1")
    req = plan_report.PlanRequest(
        draft=ns.draft,
        targets=tuple(ns.target),
        alpha=ns.alpha,
        acceptance=ns.acceptance,
        link=ns.link,
        link_ms=ns.link_ms,
        max_batch=ns.max_batch,
        gamma=_gamma(ns.gamma),
        max_gamma=ns.max_gamma,
        draft_model=ns.draft_model,
        tree=ns.tree,
        tree_shape=_tree_shape(ns),
        sibling_alpha=ns.sibling_alpha,
        hub_rounds_per_s=ns.hub_rounds_per_s,
    )
    p = plan_report.build_plan(req)
    ns_list = planning.sweep(ns.max_n)
    print(plan_report.report(p, ns_list))
    if ns.json:
        plan_report.write_json(p, ns_list, ns.json)
        print(f"json: {ns.json}")
    if ns.plot:
        plan_report.plot(p, ns_list, ns.plot)
        print(f"plot: {ns.plot}")
    return 0


def _tree_shape(ns: argparse.Namespace) -> TreeShape:
    try:
        return TreeShape(ns.tree_width, ns.tree_depth, ns.tree_nodes)
    except ValueError as exc:
        raise ProfileError(f"--tree-width/-depth/-nodes: {exc}") from None


def _gamma(text: str) -> int | None:
    if text == "auto":
        return None
    if not text.isdigit():
        raise ProfileError(f"--gamma: {text!r} (want auto or an integer >= 0)")
    return int(text)
