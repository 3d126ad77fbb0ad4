"""Train an EAGLE-3 head for a target and compare it, through the hub's own proposers, with
the EAGLE-1 head and the draft LLM.

    .venv/bin/python -m scripts.train.train_eagle3_head [--steps 3000] [--ttt-steps 3]
    .venv/bin/python -m scripts.train.train_eagle3_head --recipe real  # SmolLM2's heads

(``--recipe real``: :mod:`scripts.train.real_eagle_heads`, the real target's EAGLE-3 and
EAGLE-1 heads on its self-distilled chat data; what follows is the toy recipe.)

Data: the EAGLE-1 recipe's pool (``eagle_head_data.build_pool``: real windows of the training
plays and the target's own greedy and sampled continuations; the same seeds, so the same
tokens). The target's hidden states at the head's layers (EAGLE-3's default (2, L // 2, L - 3))
are computed once, without gradients.

Loss (EAGLE-3's training-time test): the head is unrolled ``ttt_steps`` passes
(:meth:`Eagle3Head.unrolled`: pass k takes pass k-1's outputs as its hidden states, as chain
drafting does); each pass's soft cross-entropy to the target's next-token distribution
(restricted to the draft vocabulary, renormalised), weighted 0.8 ** k as EAGLE's trainer does.

Evaluation: every drafter runs in the hub's proposer on the target's verifier, in process
(``scripts.bench.inproc.bench_centralized``, the loop a hub and a target run over the wire),
greedy, on held-out prompts: accepted drafts per round at each gamma, and the draft's seconds
per round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from scripts.bench.common import BenchConfig
from scripts.bench.inproc import bench_centralized
from scripts.train.config_args import parse_config
from scripts.train.eagle_head_data import EagleTrainConfig, build_pool
from scripts.train.eval_models import encode_works, evenly_spaced
from scripts.train.shakespeare_corpus import load_corpus
from scripts.train.train_default_pair import TrainConfig, optimise_step, optimiser
from scripts.train.train_eagle_head import masked_mean, sample_batch
from starsd import models
from starsd.hub.build import load_proposer
from starsd.hub.config import HubConfig
from starsd.hub.drafters.eagle3_head import (
    Eagle3Config,
    Eagle3Head,
    default_layer_ids,
    save_eagle3_head,
)
from starsd.hub.drafters.vocab import DraftVocab, load_draft_vocab

STEP_DECAY = 0.8  # EAGLE-3's weight of training-time-test pass k: 0.8 ** k


@dataclass(frozen=True)
class Eagle3TrainConfig:
    """The recipe's knobs; the defaults make models/starsd-eagle3 for the toy target."""

    target_dir: Path = Path("models/starsd-target")
    draft_dir: Path = Path("models/starsd-draft")  # compared with, and its vocabulary (if any)
    eagle1_dir: Path = Path("models/starsd-eagle")  # compared with
    out_dir: Path = Path("models/starsd-eagle3")
    report_path: Path = Path("results/train-eagle3-head.json")
    steps: int = 3000
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 50
    ttt_steps: int = 3
    gammas: str = "1,2,4,8"
    eval_prompts: int = 8
    prompt_tokens: int = 32
    new_tokens: int = 96
    seed: int = 1234
    threads: int = 2


def head_config(target: Any, vocab: DraftVocab | None) -> Eagle3Config:
    """A head shaped like one of the target's layers, reading its default three layers."""
    c = target.config
    return Eagle3Config(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        target_hidden_size=c.hidden_size,
        vocab_size=c.vocab_size,
        draft_vocab_size=c.vocab_size if vocab is None else vocab.size,
        layer_ids=default_layer_ids(c.num_hidden_layers),
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=float(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]),
        max_position_embeddings=c.max_position_embeddings,
    )


@torch.inference_mode()
def tapped_features(
    target: Any,
    tokens: torch.Tensor,
    layers: tuple[int, ...],
    vocab: DraftVocab | None,
    batch: int = 32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One teacher-forced forward of the target over ``tokens`` [N, T]: its hidden states at
    ``layers`` side by side [N, T, 3H], its logits over the draft vocabulary [N, T, K] and its
    post-norm last hidden state [N, T, H] (EAGLE-1's feature), all float16 (to fit in memory).

    The logits are the LM head's rows of the draft vocabulary only: the full head's columns
    outside it would be computed and thrown away.
    """
    head = target.get_output_embeddings().weight
    rows = head if vocab is None else head[vocab.d2t]  # [K, H]
    feats, logits, last = [], [], []
    for start in tqdm(range(0, tokens.shape[0], batch), desc="features"):
        out = target.model(input_ids=tokens[start : start + batch], output_hidden_states=True)
        final = out.hidden_states[-1]  # after the final norm: lm_head(final) are the logits
        feats.append(torch.cat([out.hidden_states[i] for i in layers], dim=-1).half())
        logits.append(F.linear(final, rows).half())
        last.append(final.half())
    return torch.cat(feats), torch.cat(logits), torch.cat(last)


def ttt_loss(
    head: Eagle3Head,
    outs: list[torch.Tensor],
    teacher: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sum over passes k of 0.8 ** k x soft cross-entropy to ``teacher`` [B, n, K] (the
    target's distribution over the draft vocabulary); rows j < k are left out of pass k, and
    of the rest only those ``mask`` [B, n] keeps count (None: all)."""
    total = torch.zeros(())
    parts: dict[str, float] = {}
    for k, out in enumerate(outs):
        logq = F.log_softmax(head.logits(out[:, k:]).float(), dim=-1)
        p, keep = teacher[:, k:], None if mask is None else mask[:, k:]
        loss = masked_mean(-(p * logq).sum(-1), keep)
        total = total + STEP_DECAY**k * loss
        parts[f"acc{k}"] = masked_mean((logq.argmax(-1) == p.argmax(-1)).float(), keep).item()
        parts[f"ce{k}"] = loss.item()
    return total, parts


def train(
    head: Eagle3Head,
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    embed: torch.Tensor,
    config: Eagle3TrainConfig,
    mask: torch.Tensor | None = None,
) -> list[dict[str, float]]:
    """AdamW over seeded batches of the pool; returns each step's loss parts.

    ``mask`` [N, T] (None: every position): the positions t whose next-token distribution
    (the target's logits at t) is trained on.
    """
    pool, feats, logits = data
    opt, schedule = optimiser(
        head, config.lr, replace(TrainConfig(), warmup_steps=config.warmup_steps), config.steps
    )
    generator = torch.Generator().manual_seed(config.seed + 5)
    history: list[dict[str, float]] = []
    head.train()
    bar = tqdm(range(config.steps), desc="eagle3", unit="step")
    for _ in bar:
        rows, width = sample_batch(generator, pool.shape[0], config.batch_size, mask)
        tokens, taps = pool[rows, :width], feats[rows, :width].float()
        # pair j = (g_j, x_{j+1}) predicts x_{j+2}: the target's logits at position j + 1
        teacher_logits = logits[rows, 1:width].float()  # over the draft vocabulary
        keep = None if mask is None else mask[rows, 1:width]
        outs = head.unrolled(tokens[:, 1:], taps[:, :-1], embed, config.ttt_steps)
        loss, parts = ttt_loss(head, outs, F.softmax(teacher_logits, dim=-1), keep)
        optimise_step(loss, head, opt, schedule)
        history.append({"loss": loss.item(), **parts})
        bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{parts['acc0']:.3f}")
    head.eval()
    return history


def heldout_prompts(target: models.LoadedModel, config: Eagle3TrainConfig) -> list[list[int]]:
    """Prompts from the held-out plays (as the EAGLE-1 recipe's evaluation picks them)."""
    corpus = load_corpus(EagleTrainConfig().cache_dir)
    stream = encode_works(target.tokenizer, [text for _, text in corpus.heldout])
    return evenly_spaced(stream, config.eval_prompts, config.prompt_tokens)


def drafters(config: Eagle3TrainConfig) -> dict[str, HubConfig]:
    """The hub configs of the three drafters compared: EAGLE-3, EAGLE-1, the draft LLM."""
    target = str(config.target_dir)
    return {
        "eagle3": HubConfig(model=str(config.out_dir), draft_kind="eagle3", target=target),
        "eagle": HubConfig(model=str(config.eagle1_dir), draft_kind="eagle", target=target),
        "llm": HubConfig(model=str(config.draft_dir)),
    }


def compare(
    config: Eagle3TrainConfig,
    target: models.LoadedModel,
    prompts: list[list[int]] | None = None,
) -> dict[str, Any]:
    """Accepted drafts per round and draft seconds per round of every drafter, per gamma, on
    ``prompts`` (None: the held-out plays')."""
    prompts = heldout_prompts(target, config) if prompts is None else prompts
    out: dict[str, Any] = {}
    for name, hub_config in drafters(config).items():
        proposer, _ = load_proposer(hub_config)
        for g in (int(x) for x in config.gammas.split(",")):
            cfg = BenchConfig(
                "eagle3",
                str(config.target_dir),
                str(config.draft_dir),
                gamma=g,
                max_new_tokens=config.new_tokens,
            )
            _, measured = bench_centralized(target, proposer, cfg, prompts)
            out.setdefault(name, {})[str(g)] = {
                "mean_accepted": round(measured["mean_accepted"], 3),
                "draft_ms": round(1e3 * measured["draft_s"], 2),
            }
            print(f"[eval] {name} gamma {g}: {out[name][str(g)]}", flush=True)
    return out


def model_card(report: dict[str, Any]) -> str:
    """The head directory's README: what it is, how it was made, how it compares."""
    cfg, head = report["config"], report["head_config"]
    rows = [
        f"| {name} | "
        + " | ".join(
            f"{v['mean_accepted']:.2f} ({v['draft_ms']:.1f} ms)" for v in by_gamma.values()
        )
        + " |"
        for name, by_gamma in report["evaluation"].items()
    ]
    gammas = list(next(iter(report["evaluation"].values())))
    return "\n".join(
        [
            f"# {Path(cfg['out_dir']).name}",
            "",
            f"An **EAGLE-3 draft head** for `{cfg['target_dir']}`, in vLLM speculators' layout",
            "(`speculators_model_type: eagle3`): `fc` over the target's hidden states at layers",
            f"{head['layer_ids']} (transformers' `hidden_states[i]`, side by side), one decoder",
            "layer over [embedding, hidden state], a final norm and an LM head over "
            f"{head['draft_vocab_size']} tokens. Load it with",
            f"`python -m starsd.hub --draft-kind eagle3 --model {cfg['out_dir']} "
            f"--target {cfg['target_dir']}`.",
            "",
            f"Made by `make eagle3-head` ({report['parameters']:,} parameters, float16): the",
            "EAGLE-1 recipe's data (real windows and the target's own continuations,",
            f"{report['pool']['tokens']:,} tokens), {cfg['steps']} steps of batch "
            f"{cfg['batch_size']}, training-time test over {cfg['ttt_steps']} passes (weights",
            "0.8 ** k), soft cross-entropy to the target; "
            f"{report['seconds']['train']:.0f} s on 2 cores.",
            "",
            "Accepted drafts per round (and the draft's time per round), greedy, held-out prompts,",
            "each drafter in the hub's own proposer on the target's verifier:",
            "",
            "| drafter | " + " | ".join(f"gamma {g}" for g in gammas) + " |",
            "|---|" + "---|" * len(gammas),
            *rows,
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    """Build the data, train, save, compare; write the JSON report.

    ``--recipe real`` runs :mod:`scripts.train.real_eagle_heads` instead (the real target's
    EAGLE-3 and EAGLE-1 heads); the other flags are then that recipe's.
    """
    picker = argparse.ArgumentParser(add_help=False)
    picker.add_argument("--recipe", choices=("toy", "real"), default="toy")
    chosen, rest = picker.parse_known_args(argv)
    if chosen.recipe == "real":
        from scripts.train import real_eagle_heads  # it builds on this module

        real_eagle_heads.main(rest)
        return
    config = parse_config(Eagle3TrainConfig, __doc__, rest)
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.threads)
    began = time.perf_counter()
    target = models.load_causal_lm(config.target_dir, lean=False)
    vocab = load_draft_vocab(config.draft_dir)
    corpus = load_corpus(EagleTrainConfig().cache_dir)
    stream = torch.tensor(encode_works(target.tokenizer, [text for _, text in corpus.train]))
    pool = build_pool(target.model, stream, EagleTrainConfig(), target.tokenizer.bos_token_id)
    head_cfg = head_config(target.model, vocab)
    feats, logits, _ = tapped_features(target.model, pool, head_cfg.layer_ids, vocab)
    prepared = time.perf_counter()
    head = Eagle3Head(head_cfg)
    embed = target.model.get_input_embeddings().weight.detach()
    history = train(head, (pool, feats, logits), embed, config)
    trained = time.perf_counter()
    save_eagle3_head(head, vocab, config.out_dir, dtype="float16")
    tail = history[-50:]
    report = {
        "config": asdict(config),
        "head_config": asdict(head_cfg),
        "parameters": sum(p.numel() for p in head.parameters()),
        "pool": {"sequences": pool.shape[0], "tokens": pool.numel()},
        "seconds": {"prepare": round(prepared - began, 1), "train": round(trained - prepared, 1)},
        "final_losses": {k: round(statistics.mean(r[k] for r in tail), 4) for k in tail[0]},
        "evaluation": compare(config, target),
    }
    config.report_path.parent.mkdir(parents=True, exist_ok=True)
    config.report_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    (config.out_dir / "README.md").write_text(model_card(report))
    print(json.dumps({k: report[k] for k in ("seconds", "final_losses", "evaluation")}, indent=2))


if __name__ == "__main__":
    main()
