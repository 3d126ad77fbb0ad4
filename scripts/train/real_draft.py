"""Train ``models/smollm2-draft``: a 2-layer draft for SmolLM2-135M-Instruct, distilled here.

The draft is SmolLM2's own first two layers (their MLPs pruned to the most important
``intermediate`` neurons), its final norm and the embedding rows of a reduced vocabulary (the K
target tokens its answers use most, plus one row standing for every other token on the input
side), then distilled on the target's own greedy answers (:mod:`scripts.train.real_data`): soft
cross-entropy against the target's top-k next-token probabilities at each answer position. The
head over K tokens instead of 49152 keeps a draft step a small fraction of a target step; the
draft proposes nothing outside the K (q = 0 there), which the target's rejection step makes
lossless. Weights are stored as float16 (the directory stays small enough to commit) and load as
float32. Acceptance is measured per draft position on held-out topics and written to the model
card and ``results/train-real-draft.json``. Run::

    .venv/bin/python -m scripts.train.real_draft [--epochs 8] [--vocab 4096]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from scripts.train.real_data import DATA_PATH, TARGET_DIR
from starsd import models
from starsd.hub.drafters.vocab import DraftVocab, save_draft_vocab

ROOT = Path(__file__).resolve().parents[2]
DRAFT_DIR = ROOT / "models" / "smollm2-draft"
REPORT = ROOT / "results" / "train-real-draft.json"
Record = dict[str, torch.Tensor]


@dataclass(frozen=True)
class DraftConfig:
    """The draft's shape and its training."""

    layers: int = 2
    intermediate: int = 1024
    vocab: int = 4096
    epochs: int = 8
    batch: int = 16
    lr: float = 1e-3
    seed: int = 0
    threads: int = 2
    gamma: int = 5  # positions acceptance is reported for
    conversations: int = 480  # the data set's first training conversations


# --------------------------------------------------------------------------- vocabulary


def choose_vocab(train: list[Record], target: models.LoadedModel, size: int) -> DraftVocab:
    """The ``size`` target tokens the answers (and their top-k alternatives) use most, the
    end-of-turn tokens always among them."""
    counts: Counter[int] = Counter()
    for r in train:
        counts.update(r["answer"].tolist() * 4)  # what the target emits weighs most
        counts.update(r["top_ids"][:, :4].flatten().tolist())
        counts.update(r["prompt"].tolist())  # the draft reads prompts too
    ranked = [t for t in sorted(target.eos_token_ids)] + [t for t, _ in counts.most_common()]
    ids = list(dict.fromkeys(ranked))[:size]
    return DraftVocab.from_ids(torch.tensor(sorted(ids)), target.vocab_size)


def coverage(records: list[Record], vocab: DraftVocab) -> float:
    """Share of answer tokens the draft vocabulary holds (an upper bound on acceptance)."""
    answers = torch.cat([r["answer"].long() for r in records])
    return float((vocab.t2d[answers] >= 0).float().mean())


# --------------------------------------------------------------------------- the model


def draft_shape(target: LlamaForCausalLM, config: DraftConfig, rows: int) -> LlamaConfig:
    """The target's config, cut to ``layers`` layers, ``intermediate`` MLP width, K + 1 rows."""
    shape = LlamaConfig(**target.config.to_dict())
    shape.num_hidden_layers = config.layers
    shape.intermediate_size = config.intermediate
    shape.vocab_size = rows
    shape.tie_word_embeddings = True
    shape.layer_types = None
    return shape


def prune_mlp(layer: torch.nn.Module, keep: int) -> dict[str, torch.Tensor]:
    """The MLP weights of the ``keep`` neurons whose in and out weights are largest."""
    mlp = layer.mlp
    score = mlp.gate_proj.weight.norm(dim=1) * mlp.up_proj.weight.norm(dim=1)
    score = score * mlp.down_proj.weight.norm(dim=0)
    chosen = score.topk(keep).indices.sort().values
    return {
        "mlp.gate_proj.weight": mlp.gate_proj.weight[chosen],
        "mlp.up_proj.weight": mlp.up_proj.weight[chosen],
        "mlp.down_proj.weight": mlp.down_proj.weight[:, chosen],
    }


def init_draft(
    target: LlamaForCausalLM, vocab: DraftVocab, config: DraftConfig
) -> LlamaForCausalLM:
    """The draft, initialised from the target's first layers, norm and embedding rows."""
    torch.manual_seed(config.seed)
    draft = LlamaForCausalLM(draft_shape(target, config, vocab.size + 1))
    embed = target.model.embed_tokens.weight.detach()
    rows = torch.cat([embed[vocab.d2t], embed.mean(dim=0, keepdim=True)])  # [K + 1, H]
    state = {"model.embed_tokens.weight": rows, "model.norm.weight": target.model.norm.weight}
    for index in range(config.layers):
        layer = target.model.layers[index]
        own = {k: v for k, v in layer.state_dict().items() if not k.startswith("mlp.")}
        own.update(prune_mlp(layer, config.intermediate))
        state.update({f"model.layers.{index}.{k}": v for k, v in own.items()})
    result = draft.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=False)
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"draft init mismatch: {missing} {result.unexpected_keys}")
    draft.tie_weights()
    return draft


# --------------------------------------------------------------------------- training


def batch_tensors(records: list[Record], vocab: DraftVocab) -> dict[str, torch.Tensor]:
    """Right-padded draft-id inputs, the answer positions, and their soft labels.

    Position ``j`` of a row predicts token ``j + 1``: the answer's tokens are predicted from
    positions ``len(prompt) - 1 .. len(prompt) + len(answer) - 2``.
    """
    unknown = vocab.size
    seqs = [torch.cat([r["prompt"], r["answer"]]).long() for r in records]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), unknown, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = vocab.to_draft(s, unknown)
        mask[i, : len(s)] = 1
    rows, cols, labels, logp = [], [], [], []
    for i, r in enumerate(records):
        n, start = len(r["answer"]), len(r["prompt"]) - 1
        rows.append(torch.full((n,), i))
        cols.append(torch.arange(start, start + n))
        labels.append(r["top_ids"].long())
        logp.append(r["top_logp"].float())
    return {
        "ids": ids,
        "mask": mask,
        "rows": torch.cat(rows),
        "cols": torch.cat(cols),
        "labels": vocab.to_draft(torch.cat(labels), -1),  # [N, k], -1 outside the vocabulary
        "logp": torch.cat(logp),  # [N, k]
    }


def soft_loss(logits: torch.Tensor, labels: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of q (over the K draftable tokens) against the target's top-k p,
    renormalised over the tokens q can propose."""
    log_q = torch.log_softmax(
        logits[:, :-1].float(), dim=-1
    )  # [N, K]; the unknown row is never drafted
    inside = labels >= 0
    p = torch.where(inside, logp.exp(), torch.zeros_like(logp))
    p = p / p.sum(dim=-1, keepdim=True).clamp_min(1e-8)
    picked = log_q.gather(1, labels.clamp_min(0))
    return -(p * picked).sum(dim=-1).mean()


def train(
    draft: LlamaForCausalLM, train_set: list[Record], vocab: DraftVocab, config: DraftConfig
) -> list[float]:
    """AdamW with a cosine schedule, one progress line per epoch; the loss of each step."""
    steps_per_epoch = math.ceil(len(train_set) / config.batch)
    total = steps_per_epoch * config.epochs
    opt = torch.optim.AdamW(draft.parameters(), lr=config.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / total))
    )
    order = torch.Generator().manual_seed(config.seed)
    losses: list[float] = []
    start = time.perf_counter()
    draft.train()
    for epoch in range(config.epochs):
        perm = torch.randperm(len(train_set), generator=order).tolist()
        for at in range(0, len(perm), config.batch):
            t = batch_tensors([train_set[i] for i in perm[at : at + config.batch]], vocab)
            logits = draft(input_ids=t["ids"], attention_mask=t["mask"]).logits
            loss = soft_loss(logits[t["rows"], t["cols"]], t["labels"], t["logp"])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
        recent = sum(losses[-steps_per_epoch:]) / steps_per_epoch
        print(
            f"epoch {epoch + 1}/{config.epochs}: loss {recent:.3f}, "
            f"{time.perf_counter() - start:.0f} s",
            flush=True,
        )
    draft.eval()
    return losses


# --------------------------------------------------------------------------- acceptance


@torch.inference_mode()
def chain_acceptance(
    draft: LlamaForCausalLM, held_out: list[Record], vocab: DraftVocab, gamma: int
) -> list[float]:
    """P(the first i greedy draft tokens all equal the target's greedy ones), i = 1..gamma,
    over every answer position of the held-out conversations (greedy chains, as speculation
    drafts them)."""
    hits = torch.zeros(gamma)
    starts = 0
    for r in held_out:
        seq = torch.cat([r["prompt"], r["answer"]]).long()
        ids = vocab.to_draft(seq, vocab.size)
        first = len(r["prompt"])
        for t in range(first, len(seq)):
            proposed = greedy_chain(draft, ids[:t], gamma, vocab)
            truth = seq[t : t + gamma]
            same = (proposed[: len(truth)] == truth).long().cumprod(0)
            hits[: len(same)] += same
            starts += 1
    return (hits / max(1, starts)).tolist()


def greedy_chain(
    draft: LlamaForCausalLM, prefix: torch.Tensor, gamma: int, vocab: DraftVocab
) -> torch.Tensor:
    """``gamma`` greedy draft tokens (target ids) after ``prefix`` (draft ids)."""
    out = draft(input_ids=prefix[None], use_cache=True)
    cache, tokens = out.past_key_values, []
    for _ in range(gamma):
        token = out.logits[0, -1, :-1].argmax()
        tokens.append(token)
        out = draft(input_ids=token.view(1, 1), past_key_values=cache, use_cache=True)
    return vocab.to_target(torch.stack(tokens))


@torch.inference_mode()
def sampled_acceptance(draft: LlamaForCausalLM, held_out: list[Record], vocab: DraftVocab) -> float:
    """Mean over held-out answer positions of sum_x min(p(x), q(x)) at temperature 1: the chance
    that one sampled draft token is accepted (p from the target's top-k, a lower bound)."""
    t = batch_tensors(held_out, vocab)
    logits = draft(input_ids=t["ids"], attention_mask=t["mask"]).logits[t["rows"], t["cols"]]
    q = torch.softmax(logits[:, :-1].float(), dim=-1)
    inside = t["labels"] >= 0
    q_at = torch.where(inside, q.gather(1, t["labels"].clamp_min(0)), torch.zeros_like(t["logp"]))
    return float(torch.minimum(t["logp"].exp(), q_at).sum(dim=-1).mean())


# --------------------------------------------------------------------------- saving


def save_draft(draft: LlamaForCausalLM, vocab: DraftVocab, out: Path) -> None:
    """float16 weights, config, reduced vocabulary and the target's tokenizer files."""
    stage = out.with_name(f".{out.name}.partial")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    draft.to(torch.float16).save_pretrained(stage)
    draft.to(torch.float32)
    save_draft_vocab(vocab, stage)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TARGET_DIR / name, stage / name)
    shutil.rmtree(out, ignore_errors=True)
    stage.rename(out)


def card_text(report: dict) -> str:
    """The model card: what the draft is, how it was made, what it accepts."""
    c = report["config"]
    greedy = ", ".join(f"{a:.3f}" for a in report["greedy_chain_acceptance"])
    return CARD.format(
        layers=c["layers"],
        intermediate=c["intermediate"],
        vocab=c["vocab"],
        params=report["parameters"],
        answers=report["train_answers"],
        tokens=report["train_tokens"],
        epochs=c["epochs"],
        held=report["held_out_answers"],
        cover=report["coverage"]["held_out"],
        greedy=greedy,
        sampled=report["sampled_acceptance_t1"],
    )


CARD = """\
# smollm2-draft

A draft for `models/smollm2-135m-instruct` (SmolLM2-135M-Instruct), made here by
`make real-draft` (`python -m scripts.train.real_data`, then `python -m scripts.train.real_draft`).

- {layers} Llama layers of width 576: the target's first {layers} layers, their MLPs pruned to the
  {intermediate} most important neurons, and its final norm
- a reduced vocabulary of {vocab} target tokens (`draft_vocab.safetensors`: draft id -> target
  id) plus one input-only row for every other token; q is 0 outside the {vocab}, which the
  target's rejection step makes lossless
- {params:,} parameters, stored as float16, loaded as float32
- distilled for {epochs} epochs on the target's own greedy answers to {answers} chat prompts
  built from templates x topics ({tokens:,} answer tokens), soft cross-entropy against the
  target's top-32 next-token probabilities

Held-out topics ({held} conversations; the vocabulary covers {cover:.3f} of their answer tokens):

- greedy chains: P(the first i draft tokens all match the target's), i = 1..5: {greedy}
- sampled at temperature 1: chance one draft token is accepted, sum min(p, q): {sampled:.3f}

Same tokenizer files as the target (the hub checks the fingerprint).
"""


def main(argv: list[str] | None = None) -> None:
    """Train, measure, save, report."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--epochs", type=int, default=DraftConfig.epochs)
    parser.add_argument("--vocab", type=int, default=DraftConfig.vocab)
    parser.add_argument("--layers", type=int, default=DraftConfig.layers)
    parser.add_argument("--intermediate", type=int, default=DraftConfig.intermediate)
    parser.add_argument("--out", type=Path, default=DRAFT_DIR)
    parser.add_argument("--report", type=Path, default=REPORT)
    args = parser.parse_args(argv)
    config = DraftConfig(
        epochs=args.epochs, vocab=args.vocab, layers=args.layers, intermediate=args.intermediate
    )
    torch.set_num_threads(config.threads)
    data = torch.load(DATA_PATH)
    data["train"] = data["train"][: config.conversations]
    target = models.load_causal_lm(TARGET_DIR, lean=False)
    vocab = choose_vocab(data["train"], target, config.vocab)
    print(
        f"vocabulary {vocab.size}: covers {coverage(data['train'], vocab):.3f} of training and "
        f"{coverage(data['held_out'], vocab):.3f} of held-out answer tokens",
        flush=True,
    )
    draft = init_draft(target.model, vocab, config)
    before = chain_acceptance(draft, data["held_out"][:4], vocab, config.gamma)
    print(f"acceptance before training (4 held-out): {[round(a, 3) for a in before]}", flush=True)
    losses = train(draft, data["train"], vocab, config)
    greedy = chain_acceptance(draft, data["held_out"], vocab, config.gamma)
    sampled = sampled_acceptance(draft, data["held_out"], vocab)
    print(
        f"held-out greedy chain acceptance by position: {[round(a, 3) for a in greedy]}; "
        f"sampled (T=1) per token: {sampled:.3f}",
        flush=True,
    )
    save_draft(draft, vocab, args.out)
    report = {
        "config": asdict(config),
        "train_answers": len(data["train"]),
        "train_tokens": sum(len(r["answer"]) for r in data["train"]),
        "held_out_answers": len(data["held_out"]),
        "coverage": {
            "train": coverage(data["train"], vocab),
            "held_out": coverage(data["held_out"], vocab),
        },
        "loss_first_last": [losses[0], losses[-1]],
        "greedy_chain_acceptance": greedy,
        "sampled_acceptance_t1": sampled,
        "parameters": sum(p.numel() for p in draft.parameters()),
        "bytes": {p.name: p.stat().st_size for p in sorted(args.out.iterdir())},
    }
    args.report.parent.mkdir(exist_ok=True)
    args.report.write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "README.md").write_text(card_text(report))
    print(f"wrote {args.out} and {args.report}", flush=True)


if __name__ == "__main__":
    main()
