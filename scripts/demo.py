"""The StarSD demo: one draft hub, several target processes, compared with the targets alone.

    python scripts/demo.py [--targets 3] [--max-new-tokens 64] [--target DIR] [--draft DIR]

Phase 1 runs every target standalone (plain autoregressive decoding, the baseline); phase 2 runs
the same prompts with one shared hub. Both phases run the targets at once, as separate processes
on this machine. Prints a per-target table, checks that every greedy output equals the standalone
one token for token, and ends with one machine-readable line:

    demo: targets=3 speedup=<x.xx> identical=<yes|no>

Exits 1 if any greedy output differs. Every process it starts is stopped on exit or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from harness import PROMPTS, REPO, Processes, start_hub

SAMPLED = {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "seed": 1}


@dataclass(frozen=True)
class DemoConfig:
    """Everything the demo is told."""

    target: str
    draft: str
    targets: int = 3
    prompts_per_target: int = 2
    max_new_tokens: int = 64
    gamma: int = 4
    out: str = "results/demo.json"


def write_inputs(config: DemoConfig, work: Path) -> list[Path]:
    """One JSONL per target: its greedy prompts, plus one sampled request on the first target."""
    paths = []
    for t in range(config.targets):
        rows = []
        for k in range(config.prompts_per_target):
            prompt = PROMPTS[(t * config.prompts_per_target + k) % len(PROMPTS)]
            rows.append({"id": f"t{t}-greedy{k}", "prompt": prompt})
        if t == 0:
            rows.append({"id": "t0-sampled", "prompt": PROMPTS[-1], **SAMPLED})
        path = work / f"in{t}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths


def run_phase(
    config: DemoConfig, procs: Processes, inputs: list[Path], work: Path, hub: str | None
) -> list[list[dict]]:
    """Run all targets at once (standalone when ``hub`` is None); returns their JSONL rows."""
    name = "standalone" if hub is None else "starsd"
    mode = ["--standalone"] if hub is None else ["--hub", hub, "--gamma", str(config.gamma)]
    running = []
    for t, path in enumerate(inputs):
        out = work / f"{name}{t}.jsonl"
        args = ["-m", "edge.target", "--model", config.target, "--prompts", str(path), "--out",
                str(out), "--max-new-tokens", str(config.max_new_tokens), *mode]  # fmt: skip
        running.append((procs.start(args, work / f"{name}{t}.log"), out, work / f"{name}{t}.log"))
    rows = []
    for proc, out, log in running:
        if proc.wait(timeout=600) != 0:
            raise RuntimeError(f"{name} target failed:\n{log.read_text()[-3000:]}")
        rows.append([json.loads(line) for line in out.read_text().splitlines()])
    return rows


def decode_rate(rows: list[dict], greedy_only: bool = True) -> tuple[int, float]:
    """(tokens, seconds of decoding) over a target's sequences, from their JSONL stats."""
    tokens, seconds = 0, 0.0
    for row in rows:
        if greedy_only and "greedy" not in str(row["id"]):
            continue
        n = len(row["token_ids"])
        tokens += n
        seconds += n / max(row["stats"]["tokens_per_s"], 1e-9)
    return tokens, seconds


def summarise(base: list[list[dict]], spec: list[list[dict]]) -> dict:
    """Per-target figures, the system speedup and the token-for-token check."""
    per_target, identical = [], True
    for t, (b_rows, s_rows) in enumerate(zip(base, spec, strict=True)):
        b_tok, b_s = decode_rate(b_rows)
        s_tok, s_s = decode_rate(s_rows)
        rounds = sum(r["stats"]["rounds"] for r in s_rows)
        accepted = sum(r["stats"]["accepted"] for r in s_rows)
        same = all(b["token_ids"] == s["token_ids"] for b, s in zip(b_rows, s_rows, strict=True)
                   if "greedy" in str(b["id"]))  # fmt: skip
        identical &= same
        per_target.append({
            "target": t, "tokens": s_tok, "standalone_tokens_per_s": b_tok / b_s,
            "starsd_tokens_per_s": s_tok / s_s, "speedup": (s_tok / s_s) / (b_tok / b_s),
            "mean_accepted": accepted / max(rounds, 1), "rounds": rounds,
            "greedy_identical": same,
        })  # fmt: skip
    system_base = sum(p["standalone_tokens_per_s"] for p in per_target)
    system_spec = sum(p["starsd_tokens_per_s"] for p in per_target)
    return {"per_target": per_target, "system_standalone_tokens_per_s": system_base,
            "system_starsd_tokens_per_s": system_spec, "speedup": system_spec / system_base,
            "identical": identical}  # fmt: skip


def print_report(summary: dict, spec: list[list[dict]], gamma: int) -> None:
    head = ("target", "tokens", "alone tok/s", "StarSD tok/s", "speedup", "accepted/round",
            "accept rate", "greedy same")  # fmt: skip
    widths = (6, 6, 11, 12, 7, 14, 11, 11)
    print("\n" + " ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    for p in summary["per_target"]:
        rate = p["mean_accepted"] / gamma
        print(f"{p['target']:>6} {p['tokens']:>6} {p['standalone_tokens_per_s']:>11.1f} "
              f"{p['starsd_tokens_per_s']:>12.1f} {p['speedup']:>6.2f}x "
              f"{p['mean_accepted']:>14.2f} {rate:>11.2f} "
              f"{'yes' if p['greedy_identical'] else 'NO':>11}")  # fmt: skip
    print(f"system: standalone {summary['system_standalone_tokens_per_s']:.1f} tok/s, "
          f"StarSD {summary['system_starsd_tokens_per_s']:.1f} tok/s")  # fmt: skip
    for rows in spec:
        for row in rows:
            kind = "sampled" if "sampled" in str(row["id"]) else "greedy"
            text = row["text"].replace("\n", " / ")[:110]
            print(f"  [{row['id']}] ({kind}) {row['prompt'].splitlines()[-1]!r} -> {text!r}")


def run(config: DemoConfig) -> int:
    """Both phases, the report and the summary line; returns the exit code."""
    procs = Processes()
    with tempfile.TemporaryDirectory(prefix="starsd-demo-") as tmp:
        work = Path(tmp)
        try:
            inputs = write_inputs(config, work)
            print(f"[1/2] {config.targets} targets standalone (the baseline) ...", flush=True)
            base = run_phase(config, procs, inputs, work, hub=None)
            print(f"[2/2] one hub + {config.targets} targets (StarSD) ...", flush=True)
            hub, endpoint = start_hub(procs, config.draft, work / "hub.log",
                                      "--gamma", str(config.gamma))  # fmt: skip
            spec = run_phase(config, procs, inputs, work, hub=endpoint)
            hub.send_signal(signal.SIGTERM)
            hub.wait(timeout=30)
            hub_summary = [ln for ln in (work / "hub.log").read_text().splitlines()
                           if "hub:" in ln or "target " in ln][-1 - config.targets :]  # fmt: skip
        finally:
            procs.stop_all()
    summary = summarise(base, spec)
    print_report(summary, spec, config.gamma)
    print("hub summary:\n  " + "\n  ".join(line.split(" INFO ")[-1] for line in hub_summary))
    Path(config.out).parent.mkdir(parents=True, exist_ok=True)
    Path(config.out).write_text(json.dumps({"config": config.__dict__, **summary}, indent=2))
    identical = "yes" if summary["identical"] else "no"
    print(f"demo: targets={config.targets} speedup={summary['speedup']:.2f} identical={identical}")
    return 0 if summary["identical"] else 1


def parse_args(argv: list[str] | None = None) -> DemoConfig:
    """argparse -> DemoConfig."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=str(REPO / "models" / "starsd-target"))
    p.add_argument("--draft", default=str(REPO / "models" / "starsd-draft"))
    p.add_argument("--targets", type=int, default=DemoConfig.targets)
    p.add_argument("--prompts-per-target", type=int, default=DemoConfig.prompts_per_target)
    p.add_argument("--max-new-tokens", type=int, default=DemoConfig.max_new_tokens)
    p.add_argument("--gamma", type=int, default=DemoConfig.gamma)
    p.add_argument("--out", default=DemoConfig.out)
    return DemoConfig(**vars(p.parse_args(argv)))


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM takes the same clean-up path as Ctrl-C


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    for path in (config.target, config.draft):
        if not (Path(path) / "config.json").exists():
            print(f"no model at {path}: run `make models` first", file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return run(config)
    except KeyboardInterrupt:
        print("demo: interrupted; all processes stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
