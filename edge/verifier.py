"""Target-side state of one sequence (p side): verification, commit, KV rollback, stopping.

Invariant: the KV cache holds every committed token except the last one, ``last``, whose logits
are computed by the next forward. Verification therefore feeds ``[last, d_1 .. d_gamma]`` in ONE
target forward and reads gamma + 1 distributions from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from starsd import models, sampling
from starsd.protocol import SamplingParams
from starsd.stats import latency_summary


@dataclass
class SequenceStats:
    """What the JSONL output reports per sequence."""

    rounds: int = 0
    accepted: int = 0
    proposed: int = 0
    target_forwards: int = 0
    standalone_steps: int = 0  # tokens decoded without the hub (fallback)
    alone_steps: int = 0  # tokens decoded alone because the hub asked (gamma 0)
    started: float = field(default_factory=time.perf_counter)
    finished: float = 0.0
    last_commit: float = field(default_factory=time.perf_counter)
    token_latency_s: list[float] = field(default_factory=list)  # per token: its round / tokens

    def record_commit(self, tokens: int) -> None:
        now = time.perf_counter()
        self.token_latency_s.extend([(now - self.last_commit) / tokens] * tokens)
        self.last_commit = now

    def as_dict(self, generated: int) -> dict[str, Any]:
        wall = max((self.finished or time.perf_counter()) - self.started, 1e-9)
        latency = latency_summary(self.token_latency_s)
        return {
            "rounds": self.rounds,
            "accepted": self.accepted,
            "mean_accepted": round(self.accepted / self.rounds, 4) if self.rounds else 0.0,
            "standalone_steps": self.standalone_steps,
            "alone_steps": self.alone_steps,
            "tokens_per_s": round(generated / wall, 3),
            "latency_ms": {k: round(v, 4) for k, v in latency.items()},
        }


class TargetSequence:
    """One sequence on the target: committed tokens, KV cache, sampler, stop conditions."""

    def __init__(
        self,
        target: models.LoadedModel,
        prompt: list[int],
        params: SamplingParams,
        max_new_tokens: int,
        collect_features: bool = False,
    ) -> None:
        if not prompt:
            raise ValueError("the prompt must have at least one token")
        self.target = target
        self.prompt = list(prompt)
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.generator = sampling.make_generator(params.seed)
        self.generated: list[int] = []
        self.done = max_new_tokens <= 0
        self.stats = SequenceStats()
        self.cache: Any = models.new_cache(target)
        # EAGLE hubs draft from the target's features: one row per committed position but the
        # last (whose forward has not run yet), kept in float16 for the wire.
        self.collect_features = collect_features
        self.feature_rows: list[torch.Tensor] = []  # each [H] float16
        # Called (in whichever thread commits) with each run of newly committed tokens: the
        # HTTP server (edge.serve) streams them as they land. None: nobody listens.
        self.on_commit: Callable[[list[int]], None] | None = None
        if len(prompt) > 1:
            _, features = self._forward(prompt[:-1])  # prefill all but the last token
            self._keep_features(features, len(prompt) - 1)
        self.stats.last_commit = time.perf_counter()  # latency counts decoding, not the prefill

    @property
    def last(self) -> int:
        return self.generated[-1] if self.generated else self.prompt[-1]

    @property
    def committed(self) -> int:
        """Number of committed tokens (prompt + generated)."""
        return len(self.prompt) + len(self.generated)

    def step(self) -> int:
        """Standalone decoding: one target forward, one token (the baseline)."""
        self.stats.target_forwards += 1
        logits, features = self._forward([self.last])  # [1, V], [1, H]
        self._keep_features(features, 1)
        token = sampling.next_token(logits[-1], self.params, self.generator)
        self._commit([token])
        return token

    def verify(
        self, draft_tokens: list[int], q_probs: torch.Tensor | None
    ) -> tuple[int, list[int]]:
        """Verify a proposal in one forward; commit the result.

        ``q_probs`` is the draft distribution [gamma, V] (None when greedy). Returns (accepted,
        appended): how many draft tokens were kept and the target's own token after them.
        """
        gamma = len(draft_tokens)
        cached = self.committed - 1
        self.stats.target_forwards += 1
        logits, features = self._forward([self.last, *draft_tokens])  # [gamma + 1, V], [.., H]
        accepted, token = self._judge(draft_tokens, q_probs, logits)
        models.crop_cache(self.cache, cached + 1 + accepted)  # keep last + accepted drafts
        self._keep_features(features, accepted + 1)
        self.stats.rounds += 1
        self.stats.proposed += gamma
        self.stats.accepted += accepted
        self._commit([*draft_tokens[:accepted], token])
        return accepted, [token]

    def _judge(
        self, draft_tokens: list[int], q_probs: torch.Tensor | None, p_logits: torch.Tensor
    ) -> tuple[int, int]:
        drafts = torch.tensor(draft_tokens, dtype=torch.long)  # [gamma]
        if not draft_tokens:  # nothing to verify: the target's own next token
            return 0, sampling.next_token(p_logits[0], self.params, self.generator)
        if self.params.greedy:
            return sampling.greedy_verify(drafts, p_logits)
        if q_probs is None:
            raise ValueError("a sampled sequence needs the draft probabilities")
        p = sampling.probs_from_logits(p_logits, self.params)  # [gamma + 1, V]
        accepted, token = sampling.rejection_sample(
            drafts[None], q_probs[None], p[None], self.generator
        )
        return int(accepted[0]), int(token[0])

    def features(self, start: int, stop: int) -> np.ndarray:
        """Features of positions ``start .. stop - 1`` as [n, H] float16 (collect_features)."""
        rows = self.feature_rows[start:stop]
        if len(rows) != stop - start:
            raise ValueError(f"features {start}..{stop} not available ({len(self.feature_rows)})")
        if not rows:
            return np.zeros((0, models.hidden_size(self.target)), dtype=np.float16)
        return torch.stack(rows).numpy()

    def _forward(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [n, V] and, with collect_features, features [n, H] float16 (else None)."""
        if not self.collect_features:
            return models.forward(self.target, token_ids, self.cache), None
        logits, features = models.forward_with_features(self.target, token_ids, self.cache)
        return logits, features.to(torch.float16)

    def _keep_features(self, features: torch.Tensor | None, n: int) -> None:
        """Keep the first ``n`` rows: the positions that stay committed."""
        if features is not None:
            self.feature_rows.extend(features[:n].unbind(0))

    def _commit(self, tokens: list[int]) -> None:
        # Stop exactly where the target alone would: at the first EOS (kept) or the length limit.
        self.stats.record_commit(len(tokens))
        start = len(self.generated)
        for token in tokens:
            self.generated.append(token)
            if token in self.target.eos_token_ids or len(self.generated) >= self.max_new_tokens:
                self._finish()
                break
        if self.on_commit is not None:
            self.on_commit(self.generated[start:])

    def _finish(self) -> None:
        self.done = True
        self.stats.finished = time.perf_counter()
        self.cache = None  # free the KV cache as soon as the sequence ends


def fits_context(seq: TargetSequence, gamma: int) -> bool:
    """Whether verifying ``gamma`` more tokens stays inside the target's position limit."""
    limit = seq.target.max_positions
    return limit is None or seq.committed + gamma <= limit
