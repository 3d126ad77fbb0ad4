"""Self-distillation data for the real draft: SmolLM2's own greedy answers to prompts built here.

Each record is one conversation: the chat-formatted prompt ids, the target's greedy answer ids and,
for every answer position, the target's top-k next-token log-probabilities (the soft labels the
draft is distilled on). Generation is batched (left padding) through transformers' ``generate``,
deterministic (greedy, float32), and shows one progress line per batch. Run::

    .venv/bin/python -m scripts.train.real_data [--prompts 480] [--max-new-tokens 96] [--out PATH]

A data set already on disk that was made the same way with at least ``--prompts`` conversations
is kept, and a shorter one is extended: the training prompts of a shorter set are a prefix of a
longer one's, so the draft LLM (480 conversations) and the EAGLE heads (3840) share one file.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scripts.train import chat_prompts
from scripts.train.config_args import parse_config
from starsd import models

ROOT = Path(__file__).resolve().parents[2]
TARGET_DIR = ROOT / "models" / "smollm2-135m-instruct"
DATA_PATH = ROOT / ".cache" / "real-draft" / "data.pt"


@dataclass(frozen=True)
class DataConfig:
    """How much data and where it goes."""

    target: Path = TARGET_DIR
    out: Path = DATA_PATH
    prompts: int = 480
    held_out: int = 16
    max_new_tokens: int = 96
    batch: int = 16
    top_k: int = 32
    threads: int = 2


def answer_batch(
    loaded: models.LoadedModel, prompts: list[list[int]], config: DataConfig
) -> list[dict[str, torch.Tensor]]:
    """Greedy answers to ``prompts`` with the target's top-k log-probs at each answer position."""
    pad = loaded.tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [B, width]
    lengths = torch.tensor([[len(p)] for p in prompts])
    mask = torch.arange(width) >= width - lengths  # the pad id is also <|im_end|>, so by position
    with torch.inference_mode():
        out = loaded.model.generate(
            input_ids=ids,
            attention_mask=mask.long(),
            max_new_tokens=config.max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=pad,
        )
    logits = torch.stack(out.logits, dim=1).float()  # [B, new, V]
    top = torch.log_softmax(logits, dim=-1).topk(config.top_k, dim=-1)
    return [record(p, out.sequences[i, width:], top, i, loaded) for i, p in enumerate(prompts)]


def record(
    prompt: list[int],
    answer: torch.Tensor,
    top: torch.return_types.topk,
    row: int,
    loaded: models.LoadedModel,
) -> dict[str, torch.Tensor]:
    """One conversation, the answer cut after its first end-of-sequence token."""
    answer = answer.tolist()
    end = next((i + 1 for i, t in enumerate(answer) if t in loaded.eos_token_ids), len(answer))
    return {
        "prompt": torch.tensor(prompt, dtype=torch.int32),
        "answer": torch.tensor(answer[:end], dtype=torch.int32),
        "top_ids": top.indices[row, :end].to(torch.int32),  # [n, k]
        "top_logp": top.values[row, :end].to(torch.float16),  # [n, k]
    }


def generate(config: DataConfig, start: int = 0) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Training records ``start`` .. ``config.prompts - 1`` (and, from 0, the held-out ones),
    one progress line per batch."""
    torch.set_num_threads(config.threads)
    loaded = models.load_causal_lm(config.target)
    sets = {"train": chat_prompts.train_prompts(config.prompts)[start:]}
    if start == 0:
        sets["held_out"] = chat_prompts.held_out_prompts(config.held_out)
    data: dict[str, list[dict[str, torch.Tensor]]] = {}
    began = time.perf_counter()
    for name, conversations in sets.items():
        ids = [models.chat_prompt_ids(loaded, m) for m in conversations]
        data[name] = []
        for at in range(0, len(ids), config.batch):
            data[name] += answer_batch(loaded, ids[at : at + config.batch], config)
            tokens = sum(len(r["answer"]) for r in data[name])
            print(
                f"{name}: {len(data[name])}/{len(ids)} answers, {tokens} tokens, "
                f"{time.perf_counter() - began:.0f} s",
                flush=True,
            )
    return data


def recipe(config: DataConfig) -> dict[str, int]:
    """What decides the records' content besides how many there are."""
    return {
        "held_out": config.held_out,
        "max_new_tokens": config.max_new_tokens,
        "top_k": config.top_k,
    }


def on_disk(config: DataConfig) -> dict[str, Any] | None:
    """The data set at ``config.out`` when it was made by this recipe, else None."""
    if not config.out.exists():
        return None
    data: dict[str, Any] = torch.load(config.out, weights_only=True)
    return data if data.get("recipe") == recipe(config) else None


def holds(data: dict[str, Any] | None, config: DataConfig) -> bool:
    """Whether ``data`` (of this recipe, or None) has at least ``config.prompts`` records."""
    return data is not None and len(data["train"]) >= config.prompts


def covered(config: DataConfig) -> bool:
    """Whether ``config.out`` already holds at least ``config.prompts`` records of this recipe."""
    return holds(on_disk(config), config)


def resume_at(data: dict[str, Any] | None, config: DataConfig) -> int:
    """How many of ``data``'s training records a longer set keeps: all of them when they end on
    a batch boundary (the next batches are then those a run from scratch would make, so the
    records are the same), else none."""
    kept = len(data["train"]) if data is not None else 0
    return kept if kept % config.batch == 0 else 0


def make(config: DataConfig, old: dict[str, Any] | None) -> dict[str, Any]:
    """The data set ``config`` asks for, extending ``old`` (the one on disk) where it can."""
    start = resume_at(old, config)
    new = generate(config, start)
    if old is not None and start:
        return {**old, "train": old["train"] + new["train"]}
    return {**new, "recipe": recipe(config)}


def main(argv: list[str] | None = None) -> None:
    """Generate and save the data set (unless one that covers it is there)."""
    config = parse_config(DataConfig, __doc__, argv)
    old = on_disk(config)  # (read once: tens of MB)
    if holds(old, config):
        print(f"{config.out} already holds {config.prompts} or more conversations", flush=True)
        return
    data = make(config, old)
    config.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, config.out)
    print(f"wrote {config.out}", flush=True)


if __name__ == "__main__":
    main()
