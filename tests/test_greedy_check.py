"""The greedy check itself (tests/greedy.py), on a bigram model whose logits are a table: it
must pass the target's own output and an output that parted from it at a tie, and fail any
token the target would not pick, before or after a tie."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from greedy import greedy_mismatch

# next-token logits after each token: after 0, tokens 1 and 2 tie; 3 is EOS
TABLE = torch.tensor(
    [
        [0.0, 3.0, 3.0, 0.0],
        [0.0, 0.0, 2.0, 1.0],
        [0.0, 2.0, 0.0, 1.0],
        [1.0, 0.0, 0.0, 0.0],
    ]
)


def _bigram() -> SimpleNamespace:
    def forward(ids: torch.Tensor) -> SimpleNamespace:  # [1, L] -> logits [1, L, V]
        return SimpleNamespace(logits=TABLE[ids])

    return SimpleNamespace(model=forward, eos_token_ids={3})


def test_the_targets_own_output_passes() -> None:
    assert greedy_mismatch(_bigram(), [1], [2, 1, 2], [2, 1, 2]) is None


def test_a_token_the_target_would_not_pick_fails() -> None:
    """Catches a check that forgives any difference (a verifier keeping a rejected draft)."""
    why = greedy_mismatch(_bigram(), [1], [2, 3], [2, 1])
    assert why is not None and "token 1 is 3, the target picks 1" in why


def test_an_output_that_parted_at_a_tie_passes_only_while_it_stays_greedy() -> None:
    """After 0 the target ties 1 and 2: taking 2 where generate() took 1 is the target's own
    choice under another rounding; a wrong token after the tie still fails."""
    assert greedy_mismatch(_bigram(), [0], [2, 1, 2], [1, 2, 1]) is None
    why = greedy_mismatch(_bigram(), [0], [2, 3], [1, 2])
    assert why is not None and "token 1" in why


def test_an_output_cut_short_fails() -> None:
    """Catches a target that drops the end of a sequence (not an EOS: it was not the target's)."""
    assert greedy_mismatch(_bigram(), [1], [2, 1], [2, 1, 2]) is not None
    assert greedy_mismatch(_bigram(), [0], [2, 1], [1, 2, 1]) is not None
