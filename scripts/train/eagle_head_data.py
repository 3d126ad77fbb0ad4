"""The EAGLE head recipe's knobs and its training data: a token pool and the target's features.

Used by scripts/train/train_eagle_head.py (training) and scripts/train/eagle_head_eval.py
(evaluation, which reads the same :class:`EagleTrainConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from scripts.train.shakespeare_corpus import DEFAULT_CACHE_DIR
from scripts.train.train_default_pair import continue_batch


@dataclass(frozen=True)
class EagleTrainConfig:
    """Every knob of the recipe and its evaluation; the defaults are the shipped head."""

    target_dir: Path = Path("models/starsd-target")
    draft_dir: Path = Path("models/starsd-draft")
    out_dir: Path = Path("models/starsd-eagle")
    report_path: Path = Path("results/train-eagle-head.json")
    cache_dir: Path = DEFAULT_CACHE_DIR
    # data pool (sequences of seq_len tokens, each starting with BOS)
    seq_len: int = 128
    real_sequences: int = 512
    greedy_sequences: int = 512
    sampled_sequences: int = 256
    prompt_len: int = 32
    # training
    steps: int = 3000
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    noise_std: float = 0.2  # EAGLE's uniform noise: U(-0.5, 0.5) * noise_std * 512 / hidden
    feature_weight: float = 1.0
    logit_weight: float = 0.1
    depth: int = 1  # >1: also train on the head's own chained predictions
    init: str = "random"  # random | last | first: where the decoder layer starts
    # evaluation (eval_models.py's defaults)
    gamma: int = 4
    new_tokens: int = 96
    num_prompts: int = 8
    wide_prompts: int = 48
    prompt_tokens: int = 32
    cost_repeats: int = 9
    cost_steps: int = 32
    seed: int = 1234
    threads: int = 2
    eval_threads: int = 1


def windows(stream: torch.Tensor, count: int, length: int, bos: int, seed: int) -> torch.Tensor:
    """``count`` seeded random windows [count, length] of the stream, each starting with BOS."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - length, (count, 1), generator=generator)
    body = stream[starts + torch.arange(length - 1)]
    return torch.cat([torch.full((count, 1), bos, dtype=torch.long), body], dim=1)


def continuations(
    target: Any, prompts: torch.Tensor, new_tokens: int, temperature: float, seed: int
) -> torch.Tensor:
    """The target's continuations [N, prompt + new_tokens] of equal-length prompts, in batches."""
    generator = torch.Generator().manual_seed(seed)
    chunks = []
    for start in tqdm(range(0, prompts.shape[0], 64), desc=f"sample T={temperature}"):
        chunk = prompts[start : start + 64]
        chunks.append(continue_batch(target, chunk, new_tokens, temperature, generator))
    return torch.cat(chunks)


def build_pool(
    target: Any, stream: torch.Tensor, config: EagleTrainConfig, bos: int
) -> torch.Tensor:
    """Token pool [N, seq_len]: real windows, greedy and sampled target continuations."""
    parts = [windows(stream, config.real_sequences, config.seq_len, bos, config.seed)]
    new = config.seq_len - config.prompt_len
    for index, (count, temperature) in enumerate(
        ((config.greedy_sequences, 0.0), (config.sampled_sequences, 1.0))
    ):
        if count:
            prompts = windows(stream, count, config.prompt_len, bos, config.seed + 1 + index)
            parts.append(continuations(target, prompts, new, temperature, config.seed + 3))
    return torch.cat(parts)


@torch.inference_mode()
def target_features(target: Any, tokens: torch.Tensor, batch: int = 32) -> torch.Tensor:
    """The target's post-norm last hidden states [N, T, H] (``hidden_states[-1]``), float32."""
    chunks = []
    for start in tqdm(range(0, tokens.shape[0], batch), desc="features"):
        out = target(input_ids=tokens[start : start + batch], output_hidden_states=True)
        chunks.append(out.hidden_states[-1].float())
    return torch.cat(chunks)
