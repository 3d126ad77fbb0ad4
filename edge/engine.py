"""Run sequences to completion on one target: the API a front end (CLI, HTTP server) calls.

An :class:`Engine` owns nothing but wiring: a backend, the :class:`~edge.batcher.Batcher` all
sequences share (one model thread, batched forwards) and, optionally, a hub client. Submit a
sequence at any time with ``await engine.run(seq)`` (typically in a task per request); cancel that
task to drop the sequence: its hub session is closed and its pending work is dropped (an item
already in a forward completes, and is then ignored).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from edge.backends.base import VerifierBackend
from edge.batcher import Batcher
from edge.hubs import HubPool
from edge.speculate import Fallback, generate_speculative
from edge.verifier import TargetSequence
from starsd.protocol import SamplingParams

log = logging.getLogger("edge.engine")


class Engine:
    """A target's sequences over one batcher, with the hub's proposals when ``client`` is set."""

    def __init__(
        self,
        backend: VerifierBackend,
        batcher: Batcher,
        client: HubPool | None = None,
        gamma: int = 0,
        fallback: Fallback | None = None,
    ) -> None:
        self.backend = backend
        self.batcher = batcher
        self.client = client
        self.gamma = gamma  # 0: the hub's choice
        self.fallback = fallback or Fallback()

    def feature_taps(self) -> tuple[int, ...]:
        """The hidden states a new sequence should keep (() none): those the hubs draft from,
        and the last one while a hub has not answered yet (an EAGLE hub may be the one that
        appears). They cost a little per forward."""
        return () if self.client is None else self.client.feature_taps()

    def new_sequence(
        self, prompt: list[int], params: SamplingParams, max_new_tokens: int
    ) -> TargetSequence:
        """A sequence for :meth:`run` (not prefilled yet: :meth:`run` batches its prefill)."""
        return TargetSequence(
            self.backend, prompt, params, max_new_tokens, self.feature_taps(), prefill=False
        )

    async def run(
        self, seq: TargetSequence, on_tokens: Callable[[list[int]], None] | None = None
    ) -> TargetSequence:
        """Prefill ``seq`` and decode it to the end (EOS or its max_new_tokens).

        ``on_tokens(new_ids)`` is called on the event loop each time tokens are committed (for
        streaming). With a hub client it speculates (falling back to decoding alone whenever
        the hub is late or gone); without one it decodes alone. Every forward is batched with
        the other sequences in flight.
        """
        if on_tokens is not None:
            self.batcher.watch(seq, _streamer(seq, on_tokens))
        try:
            await self.batcher.prefill(seq)
            if self.client is None:
                while not seq.done:
                    await self.batcher.step(seq)
            else:
                await generate_speculative(
                    self.client, seq, self.gamma, self.batcher, self.fallback
                )
        finally:
            self.batcher.release(seq)
        return seq


def _streamer(
    seq: TargetSequence, on_tokens: Callable[[list[int]], None]
) -> Callable[[TargetSequence], None]:
    """A batcher watcher that passes on the tokens committed since its last call."""
    sent = len(seq.generated)

    def notify(s: TargetSequence) -> None:
        nonlocal sent
        new, sent = s.generated[sent:], len(s.generated)
        if new:
            on_tokens(new)

    return notify
