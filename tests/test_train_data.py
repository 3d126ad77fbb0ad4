"""The self-distillation data set's prompts and its reuse on disk (pure, no model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scripts.train import chat_prompts, real_data


def test_a_longer_training_set_starts_with_the_shorter_one() -> None:
    """Catches a prompt order that changes with the count: the draft LLM (480 conversations)
    and the EAGLE heads (3840) read one file and must agree on its first 480."""
    short, long = chat_prompts.train_prompts(480), chat_prompts.train_prompts(3840)
    assert long[:480] == short
    assert len({m[0]["content"] for m in long}) == 3840


def test_held_out_topics_never_appear_in_training() -> None:
    """Catches a topic added to both lists, which would make held-out acceptance a training
    figure."""
    trained = {m[0]["content"] for m in chat_prompts.train_prompts(3840)}
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


def fake_generation(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """real_data with no model: prompt ids are the prompt's index among the training prompts
    (held-out ones negative), an answer is the prompt's id; returns the batches answered."""
    train = [m[0]["content"] for m in chat_prompts.train_prompts(16)]
    held = [m[0]["content"] for m in chat_prompts.held_out_prompts(16)]
    batches: list[list[int]] = []

    def ids(_loaded: object, messages: list[dict[str, str]]) -> list[int]:
        text = messages[0]["content"]
        return [train.index(text)] if text in train else [-1 - held.index(text)]

    def answer(_loaded: object, prompts: list[list[int]], _config: object) -> list[dict]:
        batches.append([p[0] for p in prompts])
        return [{"prompt": torch.tensor(p), "answer": torch.tensor(p)} for p in prompts]

    monkeypatch.setattr(real_data.models, "load_causal_lm", lambda _path: None)
    monkeypatch.setattr(real_data.models, "chat_prompt_ids", ids)
    monkeypatch.setattr(real_data, "answer_batch", answer)
    return batches


def test_a_longer_data_set_extends_the_one_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a longer request that regenerates every record (an hour of this machine for the
    EAGLE heads' set), one that answers the wrong prompts after the kept ones, or one that
    resumes mid-batch (its batches, and so its float32 answers, would differ from a run from
    scratch)."""
    batches = fake_generation(monkeypatch)
    out = tmp_path / "data.pt"
    real_data.main(["--prompts", "4", "--out", str(out), "--batch", "2", "--held-out", "2"])
    real_data.main(["--prompts", "8", "--out", str(out), "--batch", "2", "--held-out", "2"])
    assert batches == [[0, 1], [2, 3], [-1, -2], [4, 5], [6, 7]]
    data = torch.load(out, weights_only=True)
    assert [int(r["answer"][0]) for r in data["train"]] == list(range(8))
    assert [int(r["answer"][0]) for r in data["held_out"]] == [-1, -2]
    batches.clear()
    real_data.main(["--prompts", "8", "--out", str(out), "--batch", "2", "--held-out", "2"])
    assert batches == []  # covered: nothing answered again
    torch.save({**data, "train": data["train"][:5]}, out)  # ends mid-batch
    real_data.main(["--prompts", "8", "--out", str(out), "--batch", "2", "--held-out", "2"])
    assert batches == [[0, 1], [2, 3], [4, 5], [6, 7], [-1, -2]]
