"""The real EAGLE heads' draft vocabulary: shared with the draft LLM, or chosen from the data."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from scripts.train.real_eagle_cards import vocab_words
from scripts.train.real_eagle_heads import RealHeadsConfig, head_vocab
from starsd.hub.drafters.vocab import DraftVocab, save_draft_vocab

TARGET = SimpleNamespace(eos_token_ids=frozenset({2}), vocab_size=100)


def _record(answer: list[int]) -> dict[str, torch.Tensor]:
    ids = torch.tensor(answer)
    return {"prompt": torch.tensor([1]), "answer": ids, "top_ids": ids[:, None].repeat(1, 4)}


def test_the_heads_share_the_draft_llms_vocabulary_by_default(tmp_path: Path) -> None:
    """Catches the default recipe training on another vocabulary than the committed heads'
    (it would not remake them)."""
    save_draft_vocab(DraftVocab.from_ids(torch.tensor([2, 5, 7]), 100), tmp_path)
    vocab = head_vocab(RealHeadsConfig(draft_dir=tmp_path), TARGET, [_record([9, 9])])  # type: ignore[arg-type]
    assert vocab.d2t.tolist() == [2, 5, 7]


def test_a_chosen_vocabulary_holds_the_most_used_answer_tokens_and_the_end_of_turn() -> None:
    """Catches a vocabulary that drops what the target emits most, or its end-of-turn token
    (then no draft could ever end an answer)."""
    records = [_record([40, 40, 40, 41, 41, 42])]
    config = RealHeadsConfig(draft_vocab=3, draft_dir=Path("/nonexistent"))
    vocab = head_vocab(config, TARGET, records)  # type: ignore[arg-type]
    assert sorted(vocab.d2t.tolist()) == [2, 40, 41]


def test_a_draft_dir_without_a_vocabulary_is_a_clear_error(tmp_path: Path) -> None:
    """Catches a silent fall back to the full vocabulary when the shared one is missing."""
    with pytest.raises(SystemExit, match="no draft vocabulary"):
        head_vocab(RealHeadsConfig(draft_dir=tmp_path), TARGET, [])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("chosen", "words"),
    [(0, "4096-token draft vocabulary shared with `models/smollm2-draft`"), (8192, "8192-token")],
)
def test_the_model_card_says_where_the_vocabulary_came_from(chosen: int, words: str) -> None:
    """Catches a card that calls a vocabulary chosen from the data the draft LLM's."""
    report = {
        "config": {"draft_vocab": chosen, "draft_dir": "models/smollm2-draft"},
        "data": {"draft_vocab": chosen or 4096},
    }
    assert vocab_words(report).startswith(words)
