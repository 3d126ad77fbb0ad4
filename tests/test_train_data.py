"""The self-distillation data set's prompts and its reuse on disk (pure, no model)."""

from __future__ import annotations

from pathlib import Path

import torch

from scripts.train import chat_prompts, real_data


def test_a_longer_training_set_starts_with_the_shorter_one() -> None:
    """Catches a prompt order that changes with the count: the draft LLM (480 conversations)
    and the EAGLE heads (1920) read one file and must agree on its first 480."""
    short, long = chat_prompts.train_prompts(480), chat_prompts.train_prompts(1920)
    assert long[:480] == short
    assert len({m[0]["content"] for m in long}) == 1920


def test_held_out_topics_never_appear_in_training() -> None:
    """Catches a topic added to both lists, which would make held-out acceptance a training
    figure."""
    trained = {m[0]["content"] for m in chat_prompts.train_prompts(1920)}
    for messages in chat_prompts.held_out_prompts(16):
        topic = next(t for t in chat_prompts.HELD_OUT_TOPICS if t in messages[0]["content"])
        assert not any(text.endswith(f" {topic}?") or f" {topic} " in text for text in trained)


def test_a_data_set_is_reused_only_when_it_covers_the_request(tmp_path: Path) -> None:
    """Catches a stale file reused after the recipe changed, or a short one reused for a
    longer request."""
    config = real_data.DataConfig(out=tmp_path / "data.pt", prompts=4)
    assert not real_data.covered(config)
    record = {"answer": torch.zeros(1, dtype=torch.int32)}
    torch.save(
        {"train": [record] * 4, "held_out": [], "recipe": real_data.recipe(config)}, config.out
    )
    assert real_data.covered(config)
    assert not real_data.covered(real_data.DataConfig(out=config.out, prompts=5))
    assert not real_data.covered(real_data.DataConfig(out=config.out, prompts=4, max_new_tokens=8))
    torch.save({"train": [record] * 4, "held_out": []}, config.out)
    assert not real_data.covered(config)
