"""Greedy losslessness as a check: a speculative output against the target alone's tokens.

The check is token for token, with one allowance that float32 forces. Forwards of different
shapes (a verification of 4 rows, a decode step of 1, a batch of sequences) sum in different
orders and round differently in the last bits; where the target's own two best logits lie within
that rounding of each other, ``generate()`` breaks the tie one way and a verification may break it
the other, and the two texts part there for good. So: up to the first difference the tokens must
be equal; at it, the target must be tied between the two tokens; and every token after it must be
the target's greedy choice given the output's own prefix (one forward over the whole output). A
verifier that accepts a token the target would not pick fails at that token, tie or not.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from starsd import models

# Two logits closer than this (relative to the larger, at least 1) are a float tie. Rounding in
# float32 moves a logit by ~1e-6 relative; a wrong token is short of the best by far more.
TIE = 1e-4


@functools.lru_cache(maxsize=8)
def _load(path: str) -> models.LoadedModel:
    return models.load_causal_lm(Path(path))


def _target(target: models.LoadedModel | Path) -> models.LoadedModel:
    return _load(str(target)) if isinstance(target, Path) else target


def _ids(target: models.LoadedModel, prompt: str | list[int]) -> list[int]:
    return models.encode_text(target, prompt) if isinstance(prompt, str) else list(prompt)


def greedy_mismatch(
    target: models.LoadedModel | Path,
    prompt: str | list[int],
    got: list[int],
    reference: list[int],
) -> str | None:
    """Why ``got`` is not the target's greedy output after ``prompt`` (``reference`` being its
    ``generate()`` tokens), or None when it is (equal, or parted from it only at a float tie)."""
    if got == reference:
        return None
    first = next((i for i, (a, b) in enumerate(zip(got, reference, strict=False)) if a != b), None)
    if first is None:  # one is a prefix of the other: a sequence cut short or run long
        return f"{len(got)} tokens where the target alone gives {len(reference)}"
    loaded = _target(target)
    ids = _ids(loaded, prompt)
    with torch.no_grad():
        logits = loaded.model(torch.tensor([ids + got])).logits[0, len(ids) - 1 : -1]
    # logits[i]: the target's scores for token i of the output, given the output before it
    for i in range(first, len(got)):
        best = float(logits[i].max())
        if float(logits[i, got[i]]) < best - TIE * max(1.0, abs(best)):
            gap, top = best - float(logits[i, got[i]]), int(logits[i].argmax())
            return f"token {i} is {got[i]}, the target picks {top} (gap {gap:.3g})"
    if len(got) < len(reference) and got[-1] not in loaded.eos_token_ids:
        return f"ended after {len(got)} tokens without EOS (parted at a tie at token {first})"
    return None


def assert_greedy(
    target: models.LoadedModel | Path,
    prompt: str | list[int],
    got: list[int],
    reference: list[int],
) -> None:
    """Fail unless ``got`` is the target's greedy output (see :func:`greedy_mismatch`)."""
    why = greedy_mismatch(target, prompt, got, reference)
    assert why is None, f"{prompt!r}: {why}"
