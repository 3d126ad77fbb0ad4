"""The StarSD demo: each model pair through one draft hub, compared with its targets alone.

    python -m scripts.demo [--pair both|smollm2|toy] [--targets 3] [--max-new-tokens 64]

First the real pair (SmolLM2-135M-Instruct and its trained draft): one target answers two chat
requests and continues one plain prompt, alone and then through the hub (gamma chosen by the
hub). Then the toy pair (3.5M/0.6M, committed): one hub shared by --targets target processes,
the one-for-many case. Each pair runs phase 1 standalone (plain autoregressive decoding, the
baseline) and phase 2 with the hub; prints a per-target table and the texts, checks that every
greedy output equals the standalone one token for token, and ends with one line per pair:

    demo: pair=<smollm2|toy> targets=<n> speedup=<x.xx> identical=<yes|no>

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

from scripts.bench.harness import PROMPTS, Processes, start_hub

SAMPLED = {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "seed": 1}


# The real pair's requests: chat answers (rendered by the target's chat template) and a plain
# continuation, on topics the draft was not trained on.
REAL_ROWS = (
    {"id": "chat-greedy0", "prompt": "What is an owl?", "messages": "user"},
    {"id": "chat-greedy1", "prompt": "Explain lightning in simple terms.", "messages": "user"},
    {"id": "text-greedy2", "prompt": "The history of the printing press began"},
)


@dataclass(frozen=True)
class DemoConfig:
    """Everything the demo is told."""

    target: str
    draft: str
    pair: str = "toy"  # smollm2: one target on REAL_ROWS; toy: one hub for several targets
    draft_kind: str = "llm"  # the hub's --draft-kind (the pair's default drafter)
    targets: int = 3
    prompts_per_target: int = 2
    max_new_tokens: int = 64
    gamma: int = 4
    out: str = "results/demo.json"


def write_inputs(config: DemoConfig, work: Path) -> list[Path]:
    """One JSONL per target: its greedy prompts, plus one sampled request on the first target
    (the real pair: REAL_ROWS on one target)."""
    if config.pair == "smollm2":
        rows = [_real_row(r) for r in REAL_ROWS]
        path = work / "in0.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return [path]
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


def _real_row(row: dict) -> dict:
    """A REAL_ROWS entry as a JSONL line: "messages" "user" means the prompt is one user turn."""
    out = {k: v for k, v in row.items() if k != "messages"}
    if "messages" in row:
        out["messages"] = [{"role": "user", "content": row["prompt"]}]
    return out


def run_phase(
    config: DemoConfig, procs: Processes, inputs: list[Path], work: Path, hub: str | None
) -> list[list[dict]]:
    """Run all targets at once (standalone when ``hub`` is None); returns their JSONL rows."""
    name = "standalone" if hub is None else "starsd"
    gamma = str(config.gamma if config.pair == "toy" else 0)  # 0: the hub's choice (auto)
    mode = ["--standalone"] if hub is None else ["--hub", hub, "--gamma", gamma]
    running = []
    for t, path in enumerate(inputs):
        out = work / f"{name}{t}.jsonl"
        args = [
            "-m",
            "edge.target",
            "--model",
            config.target,
            "--prompts",
            str(path),
            "--out",
            str(out),
            "--max-new-tokens",
            str(config.max_new_tokens),
            *mode,
        ]
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


def distinct_ngrams(outputs: list[list[int]], n: int = 4) -> float:
    """Distinct n-grams over all n-grams, each output on its own: how far the text is from
    looping (the toy pair's "be be be be" reads low, English high)."""
    distinct = total = 0
    for ids in outputs:
        grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
        distinct, total = distinct + len(set(grams)), total + len(grams)
    return distinct / max(total, 1)


def summarise(base: list[list[dict]], spec: list[list[dict]]) -> dict:
    """Per-target figures, the system speedup and the token-for-token check."""
    per_target, identical = [], True
    for t, (b_rows, s_rows) in enumerate(zip(base, spec, strict=True)):
        b_tok, b_s = decode_rate(b_rows)
        s_tok, s_s = decode_rate(s_rows)
        rounds = sum(r["stats"]["rounds"] for r in s_rows)
        accepted = sum(r["stats"]["accepted"] for r in s_rows)
        same = all(
            b["token_ids"] == s["token_ids"]
            for b, s in zip(b_rows, s_rows, strict=True)
            if "greedy" in str(b["id"])
        )
        identical &= same
        per_target.append(
            {
                "target": t,
                "tokens": s_tok,
                "standalone_tokens_per_s": b_tok / b_s,
                "starsd_tokens_per_s": s_tok / s_s,
                "speedup": (s_tok / s_s) / (b_tok / b_s),
                "mean_accepted": accepted / max(rounds, 1),
                "rounds": rounds,
                "greedy_identical": same,
            }
        )
    system_base = sum(p["standalone_tokens_per_s"] for p in per_target)
    system_spec = sum(p["starsd_tokens_per_s"] for p in per_target)
    return {
        "per_target": per_target,
        "system_standalone_tokens_per_s": system_base,
        "system_starsd_tokens_per_s": system_spec,
        "speedup": system_spec / system_base,
        "distinct_4grams": distinct_ngrams(
            [row["token_ids"] for rows in spec for row in rows if "greedy" in str(row["id"])]
        ),
        "identical": identical,
    }


def print_report(summary: dict, spec: list[list[dict]], gamma: int) -> None:
    head = (
        "target",
        "tokens",
        "alone tok/s",
        "StarSD tok/s",
        "speedup",
        "accepted/round",
        "accept rate",
        "greedy same",
    )
    widths = (6, 6, 11, 12, 7, 14, 11, 11)
    print("\n" + " ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    for p in summary["per_target"]:
        rate = p["mean_accepted"] / gamma
        print(
            f"{p['target']:>6} {p['tokens']:>6} {p['standalone_tokens_per_s']:>11.1f} "
            f"{p['starsd_tokens_per_s']:>12.1f} {p['speedup']:>6.2f}x "
            f"{p['mean_accepted']:>14.2f} {rate:>11.2f} "
            f"{'yes' if p['greedy_identical'] else 'NO':>11}"
        )
    print(
        f"system: standalone {summary['system_standalone_tokens_per_s']:.1f} tok/s, "
        f"StarSD {summary['system_starsd_tokens_per_s']:.1f} tok/s"
    )
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
            n = len(inputs)
            print(f"[{config.pair} 1/2] {n} target(s) standalone (the baseline) ...", flush=True)
            base = run_phase(config, procs, inputs, work, hub=None)
            print(f"[{config.pair} 2/2] one hub + {n} target(s) (StarSD) ...", flush=True)
            gamma = ["--gamma", str(config.gamma)] if config.pair == "toy" else []
            kind = ["--draft-kind", config.draft_kind, "--target", config.target]
            hub, endpoint = start_hub(procs, config.draft, work / "hub.log", *gamma, *kind)
            spec = run_phase(config, procs, inputs, work, hub=endpoint)
            hub.send_signal(signal.SIGTERM)
            hub.wait(timeout=30)
            hub_summary = [
                ln
                for ln in (work / "hub.log").read_text().splitlines()
                if "hub:" in ln or "target " in ln
            ][-1 - n :]
        finally:
            procs.stop_all()
    summary = summarise(base, spec)
    print_report(summary, spec, config.gamma)
    print("hub summary:\n  " + "\n  ".join(line.split(" INFO ")[-1] for line in hub_summary))
    Path(config.out).parent.mkdir(parents=True, exist_ok=True)
    Path(config.out).write_text(json.dumps({"config": config.__dict__, **summary}, indent=2))
    identical = "yes" if summary["identical"] else "no"
    print(
        f"demo: pair={config.pair} targets={len(spec)} speedup={summary['speedup']:.2f} "
        f"distinct4={summary['distinct_4grams']:.2f} identical={identical}"
    )
    return 0 if summary["identical"] else 1


def parse_args(argv: list[str] | None = None) -> list[DemoConfig]:
    """argparse -> one DemoConfig per pair shown (--pair both: the real pair first)."""
    from starsd import models

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pair", choices=["both", *sorted(models.PAIRS)], default="both")
    p.add_argument("--targets", type=int, default=DemoConfig.targets)
    p.add_argument("--prompts-per-target", type=int, default=DemoConfig.prompts_per_target)
    p.add_argument("--max-new-tokens", type=int, default=DemoConfig.max_new_tokens)
    p.add_argument("--gamma", type=int, default=DemoConfig.gamma)
    p.add_argument("--out", default=DemoConfig.out)
    args = vars(p.parse_args(argv))
    pairs = ["smollm2", "toy"] if args["pair"] == "both" else [args["pair"]]
    out = Path(args.pop("out"))
    del args["pair"]
    drafters = {name: next(iter(models.DRAFTERS[name].items())) for name in pairs}
    return [
        DemoConfig(
            target=str(models.PAIRS[name][0]),
            draft=str(drafters[name][1]),
            draft_kind=drafters[name][0],
            pair=name,
            out=str(out.with_name(f"{out.stem}-{name}{out.suffix}")),
            **args,
        )
        for name in pairs
    ]


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM takes the same clean-up path as Ctrl-C


def main(argv: list[str] | None = None) -> int:
    configs = parse_args(argv)
    for config in configs:
        for path in (config.target, config.draft):
            if not (Path(path) / "config.json").exists():
                print(f"no model at {path}: run `make install` first", file=sys.stderr)
                return 2
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return max(run(config) for config in configs)
    except KeyboardInterrupt:
        print("demo: interrupted; all processes stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
