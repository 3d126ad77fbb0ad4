"""``--tree``: whether a session's round drafts a token tree or a chain.

The rule is the goodput rule that picks gamma, measured instead of modelled (a tree's accepted
path has no closed form in the per-position acceptance the gamma rule uses):

* under-loaded, a session's own tokens per second: each shape's committed tokens per round
  (accepted + 1) over its whole round's seconds, from the job that asked for it to the verdict
  on it (queue, drafting, the link and the target's verification of every node, which a tree
  makes longer), pooled over the hub's sessions (they share one :class:`ShapeChooser`);
* fully loaded (the hub's :class:`~starsd.hub.policy.LoadMeter`), chains: a tree multiplies the
  rows of every draft forward, so at saturation it buys its longer path with hub time that other
  targets' chains would turn into more tokens (the field measured the same at batch > 16).

The hub decides as one, in phases: every session whose target verifies trees drafts the
phase's shape for about ``PHASE_ROUNDS`` rounds each, a round counts only if it and the
session's round before were drafted in the running phase, and a phase's figure is its counted
tokens over their seconds, every session pooled. Why one shape at a time for everyone: both
ends pay for a mix twice. A target verifies its sequences in one forward padded to the longest
row, so a chain verified beside another session's tree costs what the tree does (choosing per
session made chains look as slow as trees, and one target batching 8 sequences drafted trees
it could not afford, 0.84x its batch alone); and the hub drafts a batch's chain rows and tree
rows in separate forwards, so a batch holding both pays both (choosing per target, 8 targets
under an H100 profile split between the shapes and made 0.77x the throughput of chains alone).
The first phases try each shape; then the better one runs (with hysteresis) and the other is
tried again now and then, since which wins moves with the load, less and less often while it
keeps losing. Owned by the drafting thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger("starsd.hub")

TREE_MODES = ("auto", "on", "off")
PHASE_ROUNDS = 4  # rounds per session in one phase
MIN_PHASE = 8  # rounds in one phase, however few sessions
_SMOOTHING = 0.5  # weight of the newest phase in a shape's goodput
_TRIALS = 3  # counted rounds of each shape before the chooser trusts the comparison
# phases before the losing shape is tried again; each retry that does not win doubles the wait
# (a tree round costs a CPU target about twice a chain's: frequent retries cost more than the
# rule saves)
_RETRY_EVERY = 16
_MAX_RETRY_EVERY = 64
# keep the favoured shape while the other is at most this much better (phases of one target
# batching 8 sequences differed by 10-20% for one shape)
_HYSTERESIS = 0.15
# a shape's figure is of another load once a phase's rounds in flight are this many times more
# (or fewer) than when it was measured: every session's rate moves with the load, so a figure
# from 8 sessions against one from 64 compares the loads, not the shapes (a hub going from 8 to
# 64 emulated targets drafted half its rounds as trees that lost to chains). Rounds in flight,
# not sessions seen: sessions come and go (one of 16 rounds each), and a phase sees more of
# them than run at once
_LOAD_CHANGE = 1.5
# after the load moved, both figures rest on one phase each, one of them taken while the load
# was still settling (64 sessions opening at once read chains 20% low): switch only on twice
# the margin
_RETRIAL_HYSTERESIS = 2 * _HYSTERESIS


@dataclass
class ShapeChooser:
    """Tree or chain for the rounds of the hub's sessions (see the module docstring)."""

    goodput: dict[bool, float] = field(default_factory=dict)  # tokens/s by "is a tree"
    rounds: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    best: bool = False  # the shape the comparison favours
    current: bool = False  # the running phase's shape
    phase: int = 0  # the running phase's number (0: none yet)
    left: int = 0  # decisions left in it
    phases_since_retry: int = 0
    retry_every: int = _RETRY_EVERY  # doubles while retries lose; back to the start on a switch
    decided: bool = False  # a comparison was made (and logged)
    tokens: int = 0  # the running phase's counted rounds: tokens, seconds, how many
    seconds: float = 0.0
    counted: int = 0
    began: float = 0.0  # when the running phase began
    in_flight_s: float = 0.0  # the seconds of every round that ended in it, counted or not
    concurrency: float = 1.0  # rounds in flight in the last phase: in_flight_s over its length
    load: dict[bool, float] = field(default_factory=dict)  # concurrency of each shape's figure
    retrial: bool = False  # the running phase measures the other shape anew after a load move

    def use_tree(self, loaded: bool, now: float) -> tuple[bool, int]:
        """This round's shape (True: a tree), asked at ``now``, and the phase it belongs to
        (-1: none, a chain because the hub is fully loaded)."""
        if loaded:
            if self.current and self.phase:  # trees filled the hub
                self._filled_by_trees()
            return False, -1
        if self.left <= 0:
            self._next_phase(now)
        self.left -= 1
        return self.current, self.phase

    def observe(self, tree: bool, phases: tuple[int, int], tokens: int, seconds: float) -> None:
        """A round of that shape committed ``tokens`` in ``seconds`` (its whole round);
        ``phases``: the phases its round and the session's round before were drafted in."""
        self.in_flight_s += max(seconds, 0.0)
        if seconds <= 0 or tree != self.current or phases != (self.phase, self.phase):
            return  # not in the running phase: other sessions may have drafted the other shape
        self.tokens += tokens
        self.seconds += seconds
        self.counted += 1

    def _fold(self) -> None:
        """The phase that ends: its tokens over its seconds, into its shape's figure (a phase
        pools every session's rounds: one round's rate swings with what the target's other
        sequences do in its forward); a figure of another load is replaced, not smoothed."""
        if self.counted:
            rate, old = self.tokens / self.seconds, self.goodput.get(self.current)
            if old is not None and not self._stale(self.current):
                rate = old + _SMOOTHING * (rate - old)
            self.goodput[self.current] = rate
            self.rounds[self.current] += self.counted
            self.load[self.current] = self.concurrency
        self.tokens, self.seconds, self.counted = 0, 0.0, 0

    def _stale(self, tree: bool) -> bool:
        """Whether that shape's figure was taken under another load than the last phase's."""
        then, now = self.load.get(tree), max(self.concurrency, 1.0)
        return then is not None and max(then, now) > _LOAD_CHANGE * max(min(then, now), 1.0)

    def _next_phase(self, now: float) -> None:
        if self.phase:
            if now > self.began and self.in_flight_s > 0:  # Little's law: L = lambda W
                self.concurrency = self.in_flight_s / (now - self.began)
            self._fold()
        self.phase, self.began, self.in_flight_s = self.phase + 1, now, 0.0
        # PHASE_ROUNDS rounds per session in flight (at least MIN_PHASE: one session's 3 counted
        # rounds of a 4-round phase misjudged trees by 20%)
        self.left = max(round(PHASE_ROUNDS * self.concurrency), MIN_PHASE)
        if min(self.rounds.values()) < _TRIALS:  # try each shape first, chains first
            self.current = self.rounds[False] >= _TRIALS
            return
        if len(self.goodput) == 2:  # (no tree figure since trees filled the hub)
            if self._stale(not self.current):  # the load moved: measure the other anew
                self.current, self.retrial = not self.current, True
                return
            self._compare(_RETRIAL_HYSTERESIS if self.retrial else _HYSTERESIS)
            self.retrial = False
        self.phases_since_retry += 1
        if self.phases_since_retry >= self.retry_every:  # the losing shape once more
            self.phases_since_retry = 0
            self.retry_every = min(2 * self.retry_every, _MAX_RETRY_EVERY)
            self.current = not self.best
        else:
            self.current = self.best

    def _filled_by_trees(self) -> None:
        """The hub became fully loaded in a tree phase: trees lose at this load (a full hub
        drafts chains, whose rounds cost it less), whatever the phase's rounds so far say
        (they are the ones drafted before the hub filled: with the real draft on this CPU, 64
        sessions' tree rounds read as fast as their chains while trees made 0.5x the tokens).
        The phase ends; trees wait for their next retry, and are measured anew then."""
        self.goodput.pop(True, None)
        self.rounds[True] = max(self.rounds[True], _TRIALS)
        if self.best or not self.decided:
            log.info("token trees off: they fill the hub")
        self.best = self.current = self.retrial = False
        self.decided, self.left = True, 0
        self.tokens, self.seconds, self.counted = 0, 0.0, 0

    def _compare(self, margin: float) -> None:
        """Keep the favoured shape unless the other is better by ``margin`` (logged when it
        turns)."""
        tree, chain = self.goodput[True], self.goodput[False]
        was = self.best
        if was:
            self.best = not chain > tree * (1 + margin)
        else:
            self.best = tree > chain * (1 + margin)
        if self.best != was:
            self.retry_every, self.phases_since_retry = _RETRY_EVERY, 0
        if self.best != was or not self.decided:
            self.decided = True
            log.info(
                "token trees %s: %.1f tokens/s a session with trees, %.1f with chains",
                "on" if self.best else "off",
                tree,
                chain,
            )
