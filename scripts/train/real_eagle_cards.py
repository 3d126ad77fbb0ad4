"""The model cards (README.md) of the real target's EAGLE-3 and EAGLE-1 heads, written from the
report of :mod:`scripts.train.real_eagle_heads`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

NAMES = {"eagle3": "EAGLE-3 head", "eagle": "EAGLE-1 head", "llm": "draft LLM"}


def comparison_table(evaluation: dict[str, Any]) -> list[str]:
    """Markdown rows: accepted drafts per round (draft ms per round) per drafter and gamma."""
    if not evaluation:
        return ["(not evaluated in this run)"]
    gammas = list(next(iter(evaluation.values())))
    rows = [
        f"| {NAMES.get(name, name)} | "
        + " | ".join(f"{v['mean_accepted']:.2f} ({v['draft_ms']:.1f} ms)" for v in by.values())
        + " |"
        for name, by in evaluation.items()
    ]
    header = "| drafter | " + " | ".join(f"gamma {g}" for g in gammas) + " |"
    return [header, "|---|" + "---|" * len(gammas), *rows]


def threads(count: int) -> str:
    """``count`` CPU threads, in words."""
    return "one CPU thread" if count == 1 else f"{count} CPU threads"


def vocab_words(report: dict[str, Any]) -> str:
    """Where the heads' draft vocabulary came from, in words."""
    cfg, size = report["config"], report["data"].get("draft_vocab")
    if not cfg.get("draft_vocab"):
        return f"{size or 4096}-token draft vocabulary shared with `{cfg['draft_dir']}`"
    return f"{size}-token draft vocabulary: the tokens the training answers use most"


def what_it_is(kind: str, report: dict[str, Any]) -> list[str]:
    """The card's first paragraph: the head's layout and how to serve it."""
    cfg = report["config"]
    head_dir, target = cfg["eagle3_dir" if kind == "eagle3" else "eagle1_dir"], cfg["target_dir"]
    if kind == "eagle3":
        body = [
            f"An **EAGLE-3 draft head** for `{target}` in vLLM speculators' layout",
            "(`speculators_model_type: eagle3`): `fc` over the target's hidden states at layers",
            "2, 15 and 27 (transformers' `hidden_states[i]`, side by side), one decoder layer",
            "over [embedding, hidden state], a final norm and an LM head over a",
            f"{vocab_words(report)} (`d2t` / `t2d`).",
        ]
    else:
        body = [
            f"An **EAGLE-1 draft head** for `{target}` (EAGLE's key names): `fc` over",
            "[embedding, feature] and one decoder layer predicting the target's next post-norm",
            "last hidden state; it drafts through the target's own LM head (all 49152 tokens).",
        ]
    serve = f"--draft-kind {kind} --model {head_dir} --target {target}"
    return [*body, f"Serve it with `python -m starsd.hub {serve}`."]


def how_made(kind: str, report: dict[str, Any]) -> list[str]:
    """The card's recipe paragraph: data, loss, budget."""
    cfg, data = report["config"], report["data"]
    seconds = report["seconds"]["train_eagle3" if kind == "eagle3" else "train_eagle1"]
    loss = (
        f"training-time test over {cfg['ttt_steps']} passes (weights 0.8 ** k), soft "
        "cross-entropy to the target's distribution over the draft vocabulary; LM head and "
        "final norm start as the target's"
        if kind == "eagle3"
        else "feature SmoothL1 + 0.1 x KL to the target's distribution over the draft "
        "vocabulary's rows of its LM head, EAGLE's uniform input noise"
    )
    return [
        "Made by `make real-eagle-heads` "
        f"({report['parameters'][kind if kind == 'eagle3' else 'eagle1']:,} parameters,",
        f"float16) on SmolLM2's own greedy answers to {data['sequences']} chat prompts",
        "(`scripts/train/real_data.py`), loss on answer positions only "
        f"({data['loss_positions']:,});",
        f"{loss}. {cfg['steps']} steps of batch {cfg['batch_size']}, lr {cfg['lr']},",
        f"{seconds:.0f} s on {threads(cfg['threads'])}. The EAGLE-3 and EAGLE-1 heads of this",
        "run had the same data, steps, batches and schedule.",
    ]


def generalisation(kind: str, report: dict[str, Any]) -> list[str]:
    """Top-1 agreement with the target on training answers at the end, beside the held-out
    acceptance: the gap is what more conversations would buy."""
    losses = report["final_losses"]["eagle3" if kind == "eagle3" else "eagle1"]
    return [
        f"Its first draft token agreed with the target on {losses['acc0']:.0%} of training answer",
        "positions over the last 50 steps, against the held-out acceptance at gamma 1 above",
        f"(topics none of its {report['data']['sequences']} training conversations has): the",
        "gap is what more conversations would buy (docs/benchmarks.md).",
    ]


def card(kind: str, report: dict[str, Any]) -> str:
    """The README of the ``kind`` ("eagle3" or "eagle") head."""
    cfg = report["config"]
    name = Path(cfg["eagle3_dir" if kind == "eagle3" else "eagle1_dir"]).name
    ratio = report.get("eagle3_over_eagle1_gamma4")
    return "\n".join(
        [
            f"# {name}",
            "",
            *what_it_is(kind, report),
            "",
            *how_made(kind, report),
            "",
            f"Accepted drafts per round (and the draft's time per round), greedy, "
            f"{report['data']['eval_prompts']} held-out",
            f"chat prompts x {cfg['new_tokens']} new tokens, each drafter in the hub's own "
            "proposer on the target's",
            f"verifier, {threads(cfg.get('eval_threads', cfg['threads']))}, with the hub's "
            "defaults (on a CPU: the head's projections in int8, `--quantize auto`):",
            "",
            *comparison_table(report["evaluation"]),
            "",
            f"EAGLE-3 / EAGLE-1 accepted drafts at gamma 4: {ratio}.",
            "",
            *generalisation(kind, report),
            "",
        ]
    )


def write_cards(report: dict[str, Any]) -> None:
    """README.md into both head directories."""
    cfg = report["config"]
    for kind, key in (("eagle3", "eagle3_dir"), ("eagle", "eagle1_dir")):
        (Path(cfg[key]) / "README.md").write_text(card(kind, report))
