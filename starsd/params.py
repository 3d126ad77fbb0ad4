"""Sampling parameters: what a session's q and p share, their valid ranges and why.

Part of the wire schema (OPEN carries them; :mod:`starsd.protocol` re-exports everything here),
kept apart because the lossless sampling code, the hub and the edge all read their semantics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

from starsd.errors import ErrorCode, ProtocolError

# The valid sampling parameters: see SamplingParams.
TEMPERATURE_MIN = 1e-2
TEMPERATURE_MAX = 100.0
TOP_K_MAX = 1 << 20
SEED_LIMIT = 1 << 63


@dataclass(frozen=True)
class SamplingParams:
    """Sampling semantics shared by draft (q) and target (p).

    Valid values; anything else is refused by :meth:`validate` with INVALID_ARGUMENT, by the hub
    at OPEN and by ``edge.target`` before it loads a model:

    - ``temperature``: 0 (greedy; -0.0 too) or in [TEMPERATURE_MIN, TEMPERATURE_MAX] =
      [0.01, 100]; NaN, inf and (0, 0.01) are refused. Why the floor: logits are divided by the
      temperature in float32, and |logit| / temperature overflows float32 (3.4e38) to inf, then
      the softmax to NaN, below about 1e-35 for |logit| = 1e4 (1e-38 for |logit| = 10; under
      ~1e-45 a double even rounds to a float32 zero). 0.01 leaves 32 orders of magnitude of
      margin, is the floor vLLM clamps to, and a sampler that cold is greedy in all but name.
    - ``top_k``: an int in [0, TOP_K_MAX] = [0, 2**20]; 0 = off, k >= vocab keeps every token.
    - ``top_p``: in (0, 1]; 1 = off. Any positive value, subnormals included, is safe: a tiny one
      keeps the top token (transformers' min_tokens_to_keep=1). 0, -0.0, NaN, > 1 are refused.
    - ``seed``: None (OS entropy) or an int in [0, 2**63).

    ``sampling.probs_from_logits`` stays finite and normalised for every accepted value and any
    finite logits (it subtracts each row's max before dividing by the temperature).
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def truncated(self) -> bool:
        """True when top-k or top-p shrink the support, so q can travel as (support, probs)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    def validate(self) -> None:
        """Raise ProtocolError(INVALID_ARGUMENT) naming the first field outside its valid range
        (see the class docstring); comparisons are written so that NaN fails them."""
        t, k, p, seed = self.temperature, self.top_k, self.top_p, self.seed
        if not (_is_real(t) and (t == 0.0 or TEMPERATURE_MIN <= t <= TEMPERATURE_MAX)):
            _refuse(
                "temperature", t, f"0 (greedy) or in [{TEMPERATURE_MIN:g}, {TEMPERATURE_MAX:g}]"
            )
        if not (_is_int(k) and 0 <= k <= TOP_K_MAX):
            _refuse("top_k", k, f"an integer in [0, {TOP_K_MAX}] (0 = off)")
        if not (_is_real(p) and 0.0 < p <= 1.0):
            _refuse("top_p", p, "in (0, 1] (1 = off)")
        if not (seed is None or (_is_int(seed) and 0 <= seed < SEED_LIMIT)):
            _refuse("seed", seed, "None or an integer in [0, 2**63)")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _refuse(name: str, value: object, valid: str) -> NoReturn:
    raise ProtocolError(
        ErrorCode.INVALID_ARGUMENT, f"{name} {value!r} is out of range: must be {valid}"
    )
