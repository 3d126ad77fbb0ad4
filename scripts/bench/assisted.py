"""The main suite's paired comparison: one hub + one target over loopback against transformers'
assisted generation and the in-process centralized loop (run by ``scripts/bench/run.py --suite
main``).

Seven modes on the same committed pair, the same prompts, greedy, each measured ``reps`` times,
the order rotating from one repetition to the next (A B C ..., B C ... A, ...: this machine's
speed drifts), medians reported and compared:

* ``hf-assisted``: ``target.generate(assistant_model=draft)`` in this process, with a constant
  ``num_assistant_tokens`` = gamma and ``assistant_confidence_threshold`` = 0 set on the DRAFT's
  generation_config (transformers 5.x reads them from the assistant, not from ``generate``'s
  arguments); its output is checked token for token against the target alone.
* ``centralized``: draft and target in one process, the hub's proposer and the edge's verifier
  called directly (``scripts.bench.inproc.bench_centralized``), gamma fixed.
* ``hub-defaults``: ``python -m starsd.hub`` with its defaults (pre-drafting on, ``--gamma
  auto``) and one ``edge.target`` process opening with gamma 0 (the hub's choice) and its
  defaults (``--push 4``: the hub's branches pushed ahead of the verdict);
* ``hub-defaults-no-push``: the same, the target with ``--push 0`` (``feature_effects.push``);
* ``hub-gamma4-no-predraft``: the same hub pinned with ``--gamma 4 --predraft-branches 0``;
  and the two hubs between, one feature each: ``hub-auto-no-predraft`` (``--predraft-branches
  0``) and ``hub-gamma4-predraft`` (``--gamma 4``), so that each feature's effect shows with
  the other on and off (``feature_effects``).

The hubs are started once and serve one fresh target process per repetition; a target's rate is
its sequences' tokens over their own decoding time (process start-up excluded), as in the other
multi-process modes. Targets: the hub with its defaults >= 1.1x hf-assisted and >= 0.95x
centralized. Each hub's log gives its target's pre-draft hit rate and queue wait.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from scripts.bench.common import (
    STATS_INTERVAL_S,
    BenchConfig,
    connected_targets,
    pooled_targets,
    rotated,
)
from scripts.bench.common import target_lines as parse_target_lines
from scripts.bench.harness import Processes, start_hubs, stop
from starsd import models

HF, CENTRAL = "hf-assisted", "centralized"
HUB_DEFAULTS, HUB_PINNED = "hub-defaults", "hub-gamma4-no-predraft"
HUB_AUTO_ONLY, HUB_PREDRAFT_ONLY = "hub-auto-no-predraft", "hub-gamma4-predraft"
HUB_NO_PUSH = "hub-defaults-no-push"  # the hub's defaults, the target's --push 0
HUB_ARGS = {
    HUB_DEFAULTS: [],
    HUB_NO_PUSH: [],
    HUB_AUTO_ONLY: ["--predraft-branches", "0"],
    HUB_PREDRAFT_ONLY: ["--gamma", "4"],
    HUB_PINNED: ["--gamma", "4", "--predraft-branches", "0"],
}
TARGET_ARGS = {HUB_NO_PUSH: ["--push", "0"]}  # (every other mode: the target's defaults)
MODES = (HF, CENTRAL, *HUB_ARGS)
# (name, mode with the feature, mode without it): each feature with the other on, then off
FEATURES = (
    ("push", HUB_DEFAULTS, HUB_NO_PUSH),
    ("predraft_under_auto", HUB_DEFAULTS, HUB_AUTO_ONLY),
    ("predraft_at_gamma4", HUB_PREDRAFT_ONLY, HUB_PINNED),
    ("auto_with_predraft", HUB_DEFAULTS, HUB_PREDRAFT_ONLY),
    ("auto_without_predraft", HUB_AUTO_ONLY, HUB_PINNED),
)
TARGETS = {"hub_over_hf": 1.1, "hub_over_centralized": 0.95}  # the hub with its defaults
REPS, QUICK_REPS = 5, 3

Measure = Callable[[], dict[str, Any]]  # one repetition of one mode -> {"tokens_per_s", ...}
# (endpoint, tag, extra target arguments) -> the target's JSONL rows
RunTarget = Callable[[str, str, Sequence[str]], list[dict]]


def rotation(modes: Sequence[str], reps: int) -> list[list[str]]:
    """Each repetition's order: the modes rotated by one per repetition."""
    return [rotated(modes, r) for r in range(reps)]


def configure_assistant(draft: models.LoadedModel, gamma: int) -> None:
    """A constant ``gamma`` tokens per round, never cut short by the draft's confidence: what
    transformers 5.x reads from the assistant's generation_config."""
    config = draft.model.generation_config
    config.num_assistant_tokens = gamma
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0


def in_target_vocabulary(draft: models.LoadedModel, draft_dir: str) -> None:
    """Give a reduced-vocabulary draft (``draft_vocab.safetensors``) the target's vocabulary,
    in place, so transformers' assisted generation can run it: target ids in, mapped to draft
    ids (those without one to the reserved row), and logits out over every target id (-inf
    where the draft has no id). The draft's own cost is unchanged: the head stays K rows."""
    from torch import nn

    from starsd.hub.drafters.vocab import load_draft_vocab

    vocab = load_draft_vocab(draft_dir)
    if vocab is None:
        return
    model = draft.model

    class DraftIds(nn.Module):  # (nn.Module subclasses: transformers walks the module tree)
        def __init__(self, embed: nn.Module) -> None:
            super().__init__()
            self.embed = embed

        def forward(self, ids: Any) -> Any:
            return self.embed(vocab.to_draft(ids, unknown=vocab.size))

    class TargetLogits(nn.Module):
        def __init__(self, head: nn.Module) -> None:
            super().__init__()
            self.head = head

        def forward(self, hidden: Any) -> Any:
            logits = self.head(hidden)[..., : vocab.size]
            out = logits.new_full((*logits.shape[:-1], vocab.target_size), float("-inf"))
            out[..., vocab.d2t] = logits
            return out

    model.model.embed_tokens = DraftIds(model.model.embed_tokens)
    model.lm_head = TargetLogits(model.lm_head)
    model.config.vocab_size = vocab.target_size


def hf_assisted(
    target: models.LoadedModel,
    draft: models.LoadedModel,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
) -> dict[str, Any]:
    """transformers' assisted generation, greedy, over ``prompts`` (token ids): tokens/s over
    the ``generate`` calls' own time, and the generated ids per prompt."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()  # (a deprecation note per call otherwise)
    tokens, seconds, ids = 0, 0.0, []
    for prompt in prompts:
        x = torch.tensor([prompt])
        started = time.perf_counter()
        with torch.inference_mode():
            out = target.model.generate(
                x,
                attention_mask=torch.ones_like(x),
                assistant_model=draft.model,
                do_sample=False,
                max_new_tokens=max_new_tokens,
            )
        seconds += time.perf_counter() - started
        generated = out[0, x.shape[1] :].tolist()
        tokens += len(generated)
        ids.append(generated)
    return {"tokens_per_s": tokens / seconds, "token_ids": ids}


def measure_target(
    run_target: RunTarget, endpoint: str, tag: str, extra: Sequence[str] = ()
) -> dict[str, Any]:
    """One target process (gamma 0: the hub's choice; then ``extra`` arguments) on the prompt
    set: its rate, ids, rounds."""
    rows = run_target(endpoint, tag, ["--gamma", "0", *extra])
    tokens = sum(len(r["token_ids"]) for r in rows)
    seconds = sum(len(r["token_ids"]) / r["stats"]["tokens_per_s"] for r in rows)
    rounds = sum(r["stats"]["rounds"] for r in rows)
    return {
        "tokens_per_s": tokens / seconds,
        "token_ids": [r["token_ids"] for r in rows],
        "mean_accepted": sum(r["stats"]["accepted"] for r in rows) / max(rounds, 1),
        "alone_steps": sum(r["stats"].get("alone_steps", 0) for r in rows),
    }


def run(
    cfg: BenchConfig,
    procs: Processes,
    work: Path,
    target: models.LoadedModel,
    draft: models.LoadedModel,
    prompts: Sequence[str],
    reference: list[list[int]],
    central: Measure,
    run_target: RunTarget,
) -> dict[str, Any]:
    """The four modes, ``reps`` rotations, against ``reference`` (the target alone's ids)."""
    configure_assistant(draft, cfg.gamma)
    encoded = [models.encode_text(target, p) for p in prompts]
    logs = {m: work / f"hub-paired-{m}.log" for m in HUB_ARGS}
    hubs = dict(
        zip(
            logs,
            start_hubs(
                procs,
                cfg.draft,
                list(logs.values()),
                "--stats-interval",
                str(STATS_INTERVAL_S),
                per_hub=[HUB_ARGS[m] for m in logs],
            ),
            strict=True,
        )
    )
    modes: dict[str, Measure] = {
        HF: lambda: hf_assisted(target, draft, encoded, cfg.max_new_tokens),
        CENTRAL: central,
        **{m: _hub_mode(run_target, hubs[m][1], m) for m in logs},
    }
    reps = QUICK_REPS if cfg.quick else REPS
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    order = rotation(MODES, reps)
    try:
        for r, names in enumerate(order):
            for mode in names:
                result = modes[mode]()
                results[mode].append(result)
                print(
                    f"[paired] rep {r + 1}/{reps} {mode}: {result['tokens_per_s']:.1f} tok/s",
                    flush=True,
                )
        time.sleep(2 * STATS_INTERVAL_S)  # the hubs' last stats lines
    finally:
        for proc, _ in hubs.values():
            stop(proc)
    return summary(
        results, order, reference, {m: _hub_figures(log.read_text()) for m, log in logs.items()}
    )


def _hub_mode(run_target: RunTarget, endpoint: str, mode: str) -> Measure:
    count = iter(range(1_000_000))
    extra = TARGET_ARGS.get(mode, [])
    return lambda: measure_target(run_target, endpoint, f"paired-{mode}-{next(count)}", extra)


def _hub_figures(log: str) -> dict[str, float]:
    """The hub's targets pooled over the run: pre-draft hit rate, queue wait, mean gamma."""
    return pooled_targets(parse_target_lines(log), connected_targets(log))


def summary(
    results: dict[str, list[dict[str, Any]]],
    order: list[list[str]],
    reference: list[list[int]],
    hub_figures: dict[str, dict[str, float]],
) -> dict[str, Any]:
    """Medians per mode, the ratios the issue names (of medians, and per repetition), output
    identity with the target alone."""
    results = {m: results.get(m, []) for m in MODES}
    medians = {
        m: statistics.median(r["tokens_per_s"] for r in results[m]) for m in MODES if results[m]
    }
    ratios, per_rep = {}, {}
    pairs = [
        (f"{hub}_over_{key}".replace("-", "_"), hub, base)
        for hub in HUB_ARGS
        for base, key in ((HF, "hf"), (CENTRAL, "centralized"))
    ]
    for name, a, b in [*pairs, *FEATURES]:
        if a in medians and b in medians:
            ratios[name] = medians[a] / medians[b]
            per_rep[name] = [
                x["tokens_per_s"] / y["tokens_per_s"]
                for x, y in zip(results[a], results[b], strict=False)
            ]
    met = {
        "hub_over_hf": ratios.get("hub_defaults_over_hf", 0.0) >= TARGETS["hub_over_hf"],
        "hub_over_centralized": ratios.get("hub_defaults_over_centralized", 0.0)
        >= TARGETS["hub_over_centralized"],
    }
    identical = {
        m: all(r["token_ids"] == reference for r in results[m])
        for m in MODES
        if results[m] and "token_ids" in results[m][0]
    }
    return {
        "modes": list(MODES),
        "order": order,
        "tokens_per_s": {m: [r["tokens_per_s"] for r in results[m]] for m in MODES},
        "median_tokens_per_s": medians,
        "ratios": ratios,
        "ratios_per_rep": per_rep,
        "feature_effects": {name: ratios[name] for name, _, _ in FEATURES if name in ratios},
        "targets": TARGETS,
        "met": met,
        "identical_to_target_alone": identical,
        "hubs": hub_figures,
        "mean_accepted": {
            m: statistics.median(r["mean_accepted"] for r in results[m])
            for m in MODES
            if results[m] and "mean_accepted" in results[m][0]
        },
    }


def markdown(paired: dict[str, Any] | None) -> list[str]:
    """The comparison as markdown lines."""
    if not paired:
        return []
    med = paired["median_tokens_per_s"]
    lines = ["", "| mode (paired, medians) | tok/s | per repetition |", "|---|---|---|"]
    for m in paired["modes"]:
        reps = ", ".join(f"{x:.1f}" for x in paired["tokens_per_s"][m])
        lines.append(f"| {m} | {med.get(m, 0):.1f} | {reps} |")
    r, t = paired["ratios"], paired["targets"]
    lines.append(
        f"* hub (defaults) / hf-assisted {r.get('hub_defaults_over_hf', 0):.2f}x (target "
        f">= {t['hub_over_hf']}), / centralized {r.get('hub_defaults_over_centralized', 0):.2f}x"
        f" (target >= {t['hub_over_centralized']}); identical to the target alone: "
        f"{paired['identical_to_target_alone']}"
    )
    for hub in HUB_ARGS:
        key = hub.replace("-", "_")
        lines.append(
            f"* {hub}: / hf-assisted {r.get(f'{key}_over_hf', 0):.2f}x, / centralized "
            f"{r.get(f'{key}_over_centralized', 0):.2f}x"
        )
    lines.append(
        "* each feature (with / without): "
        + ", ".join(f"{name} {r[name]:.2f}x" for name, _, _ in FEATURES if name in r)
    )
    for m, h in paired["hubs"].items():
        lines.append(
            f"* {m}: pre-draft hit rate {h['hit_rate']:.2f}, queue wait "
            f"{h['queue_wait_ms']:.2f} ms, mean gamma {h['mean_gamma']:.2f}"
        )
    return lines
