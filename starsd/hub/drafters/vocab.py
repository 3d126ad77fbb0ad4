"""A draft's own, reduced vocabulary: a subset of the target's token ids, with maps both ways.

A draft that predicts over the few thousand tokens a target actually emits keeps its LM head
small (the head of a 49k vocabulary is most of a small draft's cost). Draft id ``i`` stands for
target id ``d2t[i]``; target ids outside the subset have no draft id, so q is 0 there: lossless,
because the target's rejection step handles any q (a target token q never proposes is simply
never accepted as a draft, only ever drawn from the residual). On the wire everything stays in
target ids.

Layouts read: StarSD's ``d2t`` (absolute target ids, [K] int64) and EAGLE-3's (``d2t`` as
offsets, target id = draft id + d2t[draft id], and ``t2d`` a [V] bool mask). Target ids on the
input side that have no draft id map to ``unknown`` (a reserved draft row, or None: refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file


@dataclass(frozen=True)
class DraftVocab:
    """Draft ids 0..K-1 -> target ids ``d2t`` (distinct, each in 0..target_size-1)."""

    d2t: torch.Tensor  # [K] int64
    target_size: int  # V
    t2d: torch.Tensor  # [V] int64: the draft id of each target id, -1 where it has none

    @classmethod
    def from_ids(cls, d2t: torch.Tensor, target_size: int) -> DraftVocab:
        """From absolute target ids; ValueError for ids out of range or repeated."""
        ids = d2t.to(torch.int64).flatten()
        if ids.numel() == 0:
            raise ValueError("a draft vocabulary needs at least one token")
        if int(ids.min()) < 0 or int(ids.max()) >= target_size:
            raise ValueError(
                f"draft vocabulary maps to target ids outside 0..{target_size - 1} "
                f"(min {int(ids.min())}, max {int(ids.max())})"
            )
        if ids.unique().numel() != ids.numel():
            raise ValueError("draft vocabulary maps two draft ids to one target id")
        t2d = torch.full((target_size,), -1, dtype=torch.int64)
        t2d[ids] = torch.arange(ids.numel())
        return cls(ids, target_size, t2d)

    @classmethod
    def from_offsets(
        cls, offsets: torch.Tensor, target_size: int, mask: torch.Tensor | None = None
    ) -> DraftVocab:
        """EAGLE-3's layout: target id = draft id + ``offsets[draft id]``; ``mask`` (its
        ``t2d``, [V] bool), when given, must mark exactly those target ids."""
        ids = torch.arange(offsets.numel()) + offsets.to(torch.int64).flatten()
        vocab = cls.from_ids(ids, target_size)
        if mask is not None:
            if mask.numel() != target_size:
                raise ValueError(
                    f"t2d has {mask.numel()} entries for a target vocabulary of {target_size}"
                )
            if not torch.equal(mask.flatten().bool(), vocab.t2d >= 0):
                raise ValueError("t2d does not mark the target ids d2t maps to")
        return vocab

    @property
    def size(self) -> int:
        """K, the draft's vocabulary size."""
        return int(self.d2t.numel())

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of ``draft_ids`` (any shape)."""
        return self.d2t.to(draft_ids.device)[draft_ids]

    def to_draft(self, target_ids: torch.Tensor, unknown: int) -> torch.Tensor:
        """Draft ids of ``target_ids`` (any shape); those without one become ``unknown``."""
        draft = self.t2d.to(target_ids.device)[target_ids]
        return torch.where(draft >= 0, draft, torch.full_like(draft, unknown))

    def expand(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """q over the target's vocabulary [..., V] from q over the draft's [..., K] (0 outside)."""
        out = draft_probs.new_zeros(*draft_probs.shape[:-1], self.target_size)
        out[..., self.d2t.to(draft_probs.device)] = draft_probs
        return out


VOCAB_FILE = "draft_vocab.safetensors"  # in a draft model's directory: tensor "d2t" [K] int64


def load_draft_vocab(model_dir: str | Path) -> DraftVocab | None:
    """The reduced vocabulary of a draft directory (``VOCAB_FILE``), None if it has none.

    The file holds ``d2t`` [K] (target ids) and, as metadata, ``target_vocab_size``; the draft
    model itself then has K + 1 token rows (the last: any target token outside the K).
    ValueError names the file and what is wrong.
    """
    path = Path(model_dir) / VOCAB_FILE
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            d2t = handle.get_tensor("d2t")
        return DraftVocab.from_ids(d2t, int(meta["target_vocab_size"]))
    except (KeyError, ValueError, OSError, SafetensorError) as exc:
        raise ValueError(f"{path}: not a draft vocabulary ({exc})") from None


def save_draft_vocab(vocab: DraftVocab, model_dir: str | Path) -> Path:
    """Write ``vocab`` as ``VOCAB_FILE`` into ``model_dir``."""
    path = Path(model_dir) / VOCAB_FILE
    save_file(
        {"d2t": vocab.d2t.contiguous()},
        str(path),
        metadata={"target_vocab_size": str(vocab.target_size)},
    )
    return path
