"""``--tree``: whether a session's round drafts a token tree or a chain.

The rule is the goodput rule that picks gamma, measured instead of modelled (a tree's accepted
path has no closed form in the per-position acceptance the gamma rule uses):

* under-loaded, a session's own tokens per second: each shape's committed tokens per round
  (accepted + 1) over its whole round's seconds, from the job that asked for it to the verdict
  on it (queue, drafting, the link and the target's verification of every node, which a tree
  makes longer), smoothed per target (its sessions share one :class:`ShapeChooser`);
* fully loaded (the hub's :class:`~starsd.hub.policy.LoadMeter`), chains: a tree multiplies the
  rows of every draft forward, so at saturation it buys its longer path with hub time that other
  targets' chains would turn into more tokens (the field measured the same at batch > 16).

Until each shape has been tried a few times the chooser alternates; afterwards it keeps the
better one (with hysteresis) and tries the other again now and then, since which wins moves
with the target's load, less and less often while it keeps losing. Owned by the drafting thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TREE_MODES = ("auto", "on", "off")
_SMOOTHING = 0.2  # weight of the newest round in a shape's goodput
_TRIALS = 3  # rounds of each shape before the chooser trusts the comparison
# rounds before the losing shape is tried again; each retry that does not win doubles the
# wait (a tree round costs a CPU target twice a chain's: retrying often would cost more than
# the rule saves)
_RETRY_EVERY = 24
_MAX_RETRY_EVERY = 768
_HYSTERESIS = 0.05  # keep the shape in use while the other is at most this much better


@dataclass
class ShapeChooser:
    """Tree or chain for the rounds of one target's sessions (see the module docstring)."""

    goodput: dict[bool, float] = field(default_factory=dict)  # tokens/s by "is a tree"
    rounds: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    current: bool = False  # the shape the last decision kept
    decisions: int = 0
    retry_every: int = _RETRY_EVERY  # doubles while retries lose; back to the start on a switch
    next_retry: int = _RETRY_EVERY

    def observe(self, tree: bool, tokens: int, seconds: float) -> None:
        """A round of that shape committed ``tokens`` in ``seconds`` (its whole round)."""
        if seconds <= 0:
            return
        rate = tokens / seconds
        old = self.goodput.get(tree)
        self.goodput[tree] = rate if old is None else old + _SMOOTHING * (rate - old)
        self.rounds[tree] += 1

    def use_tree(self, loaded: bool) -> bool:
        """This round's shape: True for a tree."""
        if loaded:
            return False
        self.decisions += 1
        if min(self.rounds.values()) < _TRIALS:  # try both first, alternating
            return self.rounds[True] <= self.rounds[False]
        if self.decisions >= self.next_retry:  # the losing shape once more (a retry)
            self.retry_every = min(2 * self.retry_every, _MAX_RETRY_EVERY)
            self.next_retry = self.decisions + self.retry_every
            return not self.current
        tree, chain = self.goodput[True], self.goodput[False]
        was = self.current
        if was:  # keep trees unless chains are clearly better, and the reverse
            self.current = not chain > tree * (1 + _HYSTERESIS)
        else:
            self.current = tree > chain * (1 + _HYSTERESIS)
        if self.current != was:
            self.retry_every = _RETRY_EVERY
            self.next_retry = self.decisions + _RETRY_EVERY
        return self.current
