"""Train an EAGLE-1 draft head for StarSD's default target and compare it with the draft LLM.

Data: the Shakespeare corpus and split of ``train_default_pair.py`` (held-out plays only for
evaluation), tokenised with the target's tokenizer. The target's features (post-norm last hidden
states, ``hidden_states[-1]``) are computed once, without gradients, for a pool of real training
windows and of the target's own continuations of training-text prompts (greedy and sampled).

Loss (EAGLE-1): SmoothL1 between predicted and true next features plus ``logit_weight`` x
KL(target || head) of the LM head applied to them, with EAGLE's uniform noise on the input
features. Optionally the head is also trained on its own chained predictions (``depth`` > 1,
"training-time test": pass p sees exactly the keys that chain drafting step p+1 sees).

Evaluation: greedy chain drafting at gamma 4 on held-out prompts, simulated round by round against
the target's greedy continuation (accepted prefix + one bonus token per round), the same
prompts and count as ``eval_models.py``; the draft LLM is measured the same way in the same run
(``eval_models.speculative_greedy``), plus per-token draft cost on one thread.

This module is the training loop and the run; the knobs and the data pool are in
``eagle_head_data.py``, the evaluation and the model card in ``eagle_head_eval.py``.

Run from the repository root::

    .venv/bin/python -m scripts.train.train_eagle_head
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, replace
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from scripts.train.config_args import parse_config
from scripts.train.eagle_head_data import EagleTrainConfig, build_pool, target_features
from scripts.train.eagle_head_eval import evaluate, model_card
from scripts.train.eval_models import encode_works
from scripts.train.shakespeare_corpus import load_corpus
from scripts.train.train_default_pair import TrainConfig, optimise_step, optimiser
from starsd import models
from starsd.hub.drafters.eagle_head import (
    EagleConfig,
    EagleHead,
    load_eagle_head,
    logits_from_features,
    save_eagle_head,
)


def parse_args(argv: list[str] | None = None) -> EagleTrainConfig:
    """Build a EagleTrainConfig from the command line; every field has a flag of the same name."""
    return parse_config(EagleTrainConfig, __doc__, argv)


def seed_everything(config: EagleTrainConfig) -> None:
    """Fix seeds, thread count and deterministic kernels."""
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.threads)
    torch.use_deterministic_algorithms(True)


def head_config(target: Any) -> EagleConfig:
    """An EAGLE head config shaped like the target's layers."""
    c = target.config
    return EagleConfig.from_json({**c.to_dict(), "num_hidden_layers": 1, "bias": True})


def init_head(head: EagleHead, target: Any, where: str) -> None:
    """Start the decoder layer from a target layer (``last`` or ``first``), or leave it random.

    The target layer's ``input_layernorm`` has no counterpart in EAGLE's layer 0 and is dropped.
    """
    if where == "random":
        return
    index = {"last": len(target.model.layers) - 1, "first": 0}[where]
    source = target.model.layers[index].state_dict()
    state = {k: v for k, v in source.items() if not k.startswith("input_layernorm.")}
    head.layers[0].load_state_dict(state)


def noisy(
    features: torch.Tensor, config: EagleTrainConfig, generator: torch.Generator
) -> torch.Tensor:
    """EAGLE's uniform input-feature noise (``AddUniformNoise`` in eagle/train/main.py)."""
    if config.noise_std <= 0:
        return features
    scale = config.noise_std * 512 / features.shape[-1]
    noise = torch.rand(features.shape, generator=generator) - 0.5
    return features + noise * scale


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``values`` over the entries ``mask`` (same shape) keeps; None: all of them."""
    if mask is None:
        return values.mean()
    weights = mask.to(values.dtype)
    return (values * weights).sum() / weights.sum().clamp(min=1.0)


def sample_batch(
    generator: torch.Generator, count: int, batch: int, mask: torch.Tensor | None
) -> tuple[torch.Tensor, int | None]:
    """Seeded rows of the pool and the columns they need: up to the last position ``mask``
    trains in any of them (right-padded sequences of unequal length); None: all columns."""
    rows = torch.randint(0, count, (batch,), generator=generator)
    if mask is None:
        return rows, None
    return rows, int(mask[rows].any(0).nonzero().max()) + 1


def head_loss(
    outs: list[torch.Tensor],
    features: torch.Tensor,
    lm_head: torch.Tensor,
    config: EagleTrainConfig,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Feature SmoothL1 + logit_weight x KL(target || head), averaged over the unrolled passes.

    ``mask`` [B, n-1] (None: all): the pairs j whose targets f_{j+1} are trained on.
    """
    target_f = features[:, 1:]  # [B, n-1, H], f_{j+1}
    teacher = F.log_softmax(logits_from_features(target_f, lm_head), dim=-1)  # [B, n-1, V]
    total = torch.zeros(())
    parts: dict[str, float] = {}
    for p, out in enumerate(outs):
        pred = out[:, p:]  # rows j >= p predict f_{j+1}
        goal, soft = target_f[:, p:], teacher[:, p:]
        keep = None if mask is None else mask[:, p:]
        vloss = masked_mean(F.smooth_l1_loss(pred, goal, reduction="none").mean(-1), keep)
        student = F.log_softmax(logits_from_features(pred, lm_head), dim=-1)
        kl = masked_mean(F.kl_div(student, soft, log_target=True, reduction="none").sum(-1), keep)
        total = total + config.feature_weight * vloss + config.logit_weight * kl
        agree = masked_mean((student.argmax(-1) == soft.argmax(-1)).float(), keep)
        parts.update({f"v{p}": vloss.item(), f"kl{p}": kl.item(), f"acc{p}": agree.item()})
    return total / len(outs), parts


def train_head(
    head: EagleHead,
    pool: torch.Tensor,
    features: torch.Tensor,
    target_weights: tuple[torch.Tensor, torch.Tensor],
    config: EagleTrainConfig,
    mask: torch.Tensor | None = None,
) -> list[dict[str, float]]:
    """AdamW on the head over seeded pool batches; returns per-step loss parts.

    ``mask`` [N, T] (None: every position): the positions t whose next-token distribution is
    trained on (the target's feature f_t is the goal of pair t - 1).
    """
    embed, lm_head = target_weights
    schedule_config = replace(
        TrainConfig(), warmup_steps=config.warmup_steps, weight_decay=config.weight_decay
    )
    opt, schedule = optimiser(head, config.lr, schedule_config, config.steps)
    generator = torch.Generator().manual_seed(config.seed + 5)
    head.train()
    history: list[dict[str, float]] = []
    bar = tqdm(range(config.steps), desc="eagle1", unit="step")
    for _ in bar:
        rows, width = sample_batch(generator, pool.shape[0], config.batch_size, mask)
        tokens, feats = pool[rows, :width], features[rows, :width].float()  # [B, T], [B, T, H]
        keep = None if mask is None else mask[rows, 1:width]
        # pair j = (f_j, x_{j+1}); the last position has no next token
        outs = head.unrolled(
            tokens[:, 1:], noisy(feats[:, :-1], config, generator), embed, config.depth
        )
        loss, parts = head_loss(outs, feats, lm_head, config, keep)
        optimise_step(loss, head, opt, schedule)
        history.append({"loss": loss.item(), **parts})
        bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{parts['acc0']:.3f}")
    head.eval()
    return history


def summarise(history: list[dict[str, float]], count: int = 50) -> dict[str, float]:
    """Mean of each loss part over the last ``count`` steps."""
    tail = history[-count:]
    return {key: round(statistics.mean(row[key] for row in tail), 4) for key in tail[0]}


def main(argv: list[str] | None = None) -> None:
    """Train, save, evaluate; write the JSON report and print it."""
    config = parse_args(argv)
    seed_everything(config)
    start = time.perf_counter()
    target_lm = models.load_causal_lm(config.target_dir, dtype="float32", lean=False)
    draft_lm = models.load_causal_lm(config.draft_dir, dtype="float32", lean=False)
    target, tokenizer = target_lm.model, target_lm.tokenizer
    corpus = load_corpus(config.cache_dir)
    stream = torch.tensor(encode_works(tokenizer, [text for _, text in corpus.train]))
    pool = build_pool(target, stream, config, tokenizer.bos_token_id)
    features = target_features(target, pool)
    prepared = time.perf_counter()

    head_cfg = head_config(target)
    head = EagleHead(head_cfg)
    init_head(head, target, config.init)
    embed = target.get_input_embeddings().weight.detach()
    lm_head = target.get_output_embeddings().weight.detach()
    history = train_head(head, pool, features, (embed, lm_head), config)
    trained = time.perf_counter()

    save_eagle_head(head, head_cfg, config.out_dir, dtype="float16")
    eagle = load_eagle_head(config.out_dir, config.target_dir, dtype="float32")
    figures = evaluate(eagle, target, draft_lm.model, tokenizer, config)
    report = {
        "config": asdict(config),
        "head_config": asdict(head_cfg),
        "parameters": sum(p.numel() for p in head.parameters()),
        "pool": {"sequences": pool.shape[0], "tokens": pool.numel()},
        "seconds": {
            "prepare": round(prepared - start, 1),
            "train": round(trained - prepared, 1),
            "total": round(time.perf_counter() - start, 1),
        },
        "final_losses": summarise(history),
        "loss_curve": [summarise(history[: i + 1], 50) for i in range(49, len(history), 100)],
        "evaluation": figures,
        "weights_bytes": (config.out_dir / "model.safetensors").stat().st_size,
        "torch": torch.__version__,
    }
    config.report_path.parent.mkdir(parents=True, exist_ok=True)
    config.report_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    (config.out_dir / "README.md").write_text(model_card(report))
    print(json.dumps({k: report[k] for k in ("seconds", "final_losses", "evaluation")}, indent=2))


if __name__ == "__main__":
    main()
