"""``--tree``: whether a session's round drafts a chain or a token tree, and which tree.

The options are a chain and the hub's tree shapes (:func:`starsd.tree_shapes.tree_ladder`: the
configured shape and smaller ones, each half the nodes and one depth less). The rule is the
goodput rule that picks gamma, measured instead of modelled (a tree's accepted path has no
closed form in the per-position acceptance the gamma rule uses):

* under-loaded, a session's own tokens per second: each shape's committed tokens per round
  (accepted + 1) over its whole round's seconds, from the job that asked for it to the verdict
  on it (queue, drafting, the link and the target's verification of every node, which a tree
  makes longer), pooled over the hub's sessions (they share one :class:`ShapeChooser`);
* fully loaded (the hub's :class:`~starsd.hub.policy.LoadMeter`), chains: a tree multiplies the
  rows of every draft forward, so at saturation it buys its longer path with hub time that other
  targets' chains would turn into more tokens (the field measured the same at batch > 16).

The hub decides as one, in phases: every session whose target verifies trees drafts the
phase's shape for about ``PHASE_ROUNDS`` rounds each. A phase's figure is the tokens over the
seconds of the rounds drafted in it, every session pooled, whenever their verdicts come back
(the phase is folded once the next one has ended: counting only the rounds that ended within
their phase kept the short ones, and read 64 sessions' trees on this CPU at 1.8x what they
made); a round counts only if the session's round before was of the same shape (the target
may have verified it beside the other shape's rows). Why one shape at a time for everyone: both
ends pay for a mix twice. A target verifies its sequences in one forward padded to the longest
row, so a chain verified beside another session's tree costs what the tree does (choosing per
session made chains look as slow as trees, and one target batching 8 sequences drafted trees
it could not afford, 0.84x its batch alone); and the hub drafts a batch's chain rows and tree
rows in separate forwards, so a batch holding both pays both (choosing per target, 8 targets
under an H100 profile split between the shapes and made 0.77x the throughput of chains alone).
The first phases try each option; then the best runs (with hysteresis) and the others are
tried again now and then, in turn, since which wins moves with the load, less and less often
while they keep losing. Owned by the drafting thread.

Which trees are worth a trial at all is the model's to say (:func:`trees_worth_trying`): a
session drafts a tree only if, priced with its target's round trip R(x) (the target's own
forward line, where it reports one) and the hub's S(B, g), with E[L] of the tree from the
session's acceptance (:func:`starsd.analytic.expected_tree_tokens`), the tree would make it more
tokens per second than its chain. A target whose verification grows with every node (a CPU's:
~12 ms a node on top of ~165 ms at 8 sequences) then drafts no 8-node tree, whose trials there
read half the chains' rate and took 10-18% of a 35-s stream's rounds; on a GPU's flat
verification the model admits them, and the measurement decides.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from starsd import analytic
from starsd.tree_shapes import TreeShape, ranked_tree

log = logging.getLogger("starsd.hub")

TREE_MODES = ("auto", "on", "off")
CHAIN = 0  # option 0: a chain; option k >= 1: the hub's k-th tree shape (tree_ladder)
PHASE_ROUNDS = 4  # rounds per session in flight in one phase
MIN_PHASE = 8  # rounds in one phase, however few sessions
_SMOOTHING = 0.5  # weight of the newest phase in a shape's goodput
_TRIALS = 3  # counted rounds a phase's figure needs (fewer: the shape is tried again)
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
# 64 emulated targets drafted half its rounds as trees that lost to chains). Rounds in flight
# (Little's law), not sessions seen: sessions come and go, and a phase sees more of them than
# run at once
_LOAD_CHANGE = 1.5
# after the load moved, a re-trial is compared with the favoured option measured in a phase
# after it (the phase the load moved in can read far off: 64 sessions opening at once read
# chains at 35 tokens/s a session, 54 a phase later), and both figures rest on one phase each:
# switch only on twice the margin (but see ShapeChooser._retrial_margin)
_RETRIAL_HYSTERESIS = 2 * _HYSTERESIS


def trees_worth_trying(
    expected: Sequence[float],
    gamma: int,
    trees: Sequence[TreeShape],
    costs: Sequence[float],
    outside: Callable[[int], float],
) -> frozenset[int]:
    """The options (CHAIN, and k for the k-th of ``trees``) the model expects to make a
    session at least as many tokens per second as its chain of ``gamma`` (>= 1): E[L] over
    S + R. ``expected``: E[L(g)] for g = 0..G; ``costs``: the hub's S(B, g) for g = 0..G (a
    tree is priced as a chain of its depth, which its wider rows cost more than: the rule
    errs toward trying it); ``outside(x)``: the round trip outside the hub with x tokens or
    nodes to verify. A tree's E[L] takes the single alpha that gives the session's E[L] at
    the tree's depth, and ``starsd.analytic.SIBLING_ALPHA`` for a node's later children."""
    top = min(len(expected), len(costs)) - 1
    gamma = min(max(gamma, 1), top)
    chain = expected[gamma] / (costs[gamma] + outside(gamma))
    worth = {CHAIN}
    for option, shape in enumerate(trees, start=1):
        depth = min(shape.depth, top)
        alpha = analytic.alpha_from_mean_accepted(expected[depth] - 1.0, depth)
        tokens = analytic.expected_tree_tokens(alpha, analytic.SIBLING_ALPHA, _parents(shape))
        if tokens / (costs[depth] + outside(shape.nodes)) >= chain:
            worth.add(option)
    return frozenset(worth)


@functools.lru_cache(maxsize=64)
def _parents(shape: TreeShape) -> tuple[int, ...]:
    """The parents of the tree the hub drafts in ``shape`` (its node budget met)."""
    return ranked_tree(shape)[1]


@dataclass
class PhaseRecord:
    """One phase: its option, and the rounds drafted in it as their verdicts come back."""

    option: int  # CHAIN, or a tree shape's number
    began: float
    concurrency: float = 0.0  # rounds in flight while it ran (set when it ends)
    tokens: int = 0
    seconds: float = 0.0
    counted: int = 0
    void: bool = False  # a tree phase that filled the hub: never folded


@dataclass
class ShapeChooser:
    """A chain or one of ``options - 1`` tree shapes for the rounds of the hub's sessions (see
    the module docstring)."""

    options: int = 2  # a chain and the tree shapes
    goodput: dict[int, float] = field(default_factory=dict)  # tokens/s by option
    load: dict[int, float] = field(default_factory=dict)  # concurrency of each option's figure
    tried: set[int] = field(default_factory=set)
    best: int = CHAIN  # the option the comparison favours
    retried: int = CHAIN  # the option retried last (the losers take turns)
    phase: int = 0  # the running phase's number (0: none yet)
    phases: dict[int, PhaseRecord] = field(default_factory=dict)  # the running one, the last
    left: int = 0  # decisions left in the running phase
    phases_since_retry: int = 0
    retry_every: int = _RETRY_EVERY  # doubles while retries lose; back to the start on a switch
    decided: bool = False  # a comparison was made (and logged)
    in_flight_s: float = 0.0  # the seconds of every round that ended in the running phase
    concurrency: float = 1.0  # rounds in flight in the last phase: in_flight_s over its length
    awaiting: int | None = None  # a re-trial after a load move: its phase, until folded
    retrial: tuple[int, float] = (CHAIN, 0.0)  # the last re-trial's option, its stale load
    taken: dict[int, int] = field(default_factory=dict)  # the phase of each option's figure
    # the options some session's model found worth trying (trees_worth_trying), in the running
    # phase and the one before (CHAIN always); None: every option
    worth: set[int] | None = None
    worth_before: set[int] | None = None

    @property
    def current(self) -> int:
        """The running phase's option (chains before any)."""
        record = self.phases.get(self.phase)
        return record.option if record is not None else CHAIN

    def use_shape(
        self, loaded: bool, now: float, worth: Iterable[int] | None = None
    ) -> tuple[int, int]:
        """This round's option (CHAIN, or a tree shape's number), asked at ``now``, and the
        phase it belongs to (-1: none, a chain because the hub is fully loaded); ``worth``: the
        options the asking session's model finds worth trying (None: all). A phase runs an
        option some session found worth it lately; a session that does not takes its chain,
        outside the phase."""
        if worth is not None:
            self.worth = (self.worth or {CHAIN}) | set(worth)
        if loaded:
            if self.current and self.phase:  # trees filled the hub
                self._filled_by_trees(now)
            return CHAIN, -1
        if self.left <= 0:
            self._next_phase(now)
        self.left -= 1
        return self.current, self.phase

    def observe(self, option: int, phases: tuple[int, int], tokens: int, seconds: float) -> None:
        """A round of that option committed ``tokens`` in ``seconds`` (its whole round);
        ``phases``: the phases its round and the session's round before were drafted in."""
        self.in_flight_s += max(seconds, 0.0)
        drafted, before = phases
        record, prior = self.phases.get(drafted), self.phases.get(before)
        if seconds <= 0 or record is None or record.option != option:
            return  # drafted outside a phase, or in one folded already
        if prior is None or prior.option != option:
            return  # the round before was of another option, or long ago
        record.tokens += tokens
        record.seconds += seconds
        record.counted += 1

    # ------------------------------------------------------------------ phases

    def _next_phase(self, now: float) -> None:
        ending = self.phases.get(self.phase)
        if ending is not None:
            if now > ending.began and self.in_flight_s > 0:  # Little's law: L = lambda W
                self.concurrency = self.in_flight_s / (now - ending.began)
            ending.concurrency = self.concurrency
            self._fold(self.phase - 1)  # its rounds are back by now
        self.phase, self.in_flight_s = self.phase + 1, 0.0
        self.worth_before, self.worth = self.worth, None
        # PHASE_ROUNDS rounds per session in flight (at least MIN_PHASE: one session's 3 counted
        # rounds of a 4-round phase misjudged trees by 20%)
        self.left = max(round(PHASE_ROUNDS * self.concurrency), MIN_PHASE)
        self.phases[self.phase] = PhaseRecord(self._choose(), now)

    def _choose(self) -> int:
        """The next phase's option: each tried first (chains first), then the comparison's,
        the others measured anew after a load move, and the losers retried now and then;
        only options some session lately found worth trying (a favoured one that is no
        longer gives way to chains)."""
        allowed = self._allowed()
        for option in range(self.options):
            if option not in self.tried and option in allowed:
                self.tried.add(option)
                return option
        if self.best not in allowed:
            self.best, self.awaiting = CHAIN, None
        if self.awaiting is not None and self.taken.get(self.best, 0) <= self.awaiting:
            return self.best  # a re-trial's rounds, or the favoured one's after it, still out
        margin = _HYSTERESIS if self.awaiting is None else self._retrial_margin()
        self.awaiting = None
        if len(self.goodput) > 1 and self.best in self.goodput:  # (trees filled the hub, ...)
            others = [o for o in self.goodput if o != self.best and o in allowed]
            stale = [o for o in others if self._may_win_now(o)]
            if stale:  # the load moved: measure another anew
                self.awaiting, self.retrial = self.phase, (stale[0], self.load[stale[0]])
                return stale[0]
            self._compare(margin, others)
        self.phases_since_retry += 1
        if self.phases_since_retry >= self.retry_every:  # a loser once more, each in turn
            self.phases_since_retry = 0
            self.retry_every = min(2 * self.retry_every, _MAX_RETRY_EVERY)
            return self._next_loser(allowed)
        return self.best

    def _allowed(self) -> set[int]:
        """The options some session found worth trying in the last two phases (every option
        until a session says)."""
        said = [w for w in (self.worth_before, self.worth) if w is not None]
        return set().union(*said) if said else set(range(self.options))

    def _retrial_margin(self) -> float:
        """The margin a re-trial after a load move switches on: twice the usual (a phase at
        the new load may still be settling), but the usual when the load rose and the option
        re-measured costs less than the favoured one. More load favours the cheaper shape (a
        tree's rows cost more at every batch), and a hub that kept the tree it chose at 8
        emulated targets while 64 ran drafted 83% of a run's rounds as trees, 0.90x chains."""
        option, then = self.retrial
        rose = self.load.get(option, then) > then
        cheaper = self._cost_rank(option) < self._cost_rank(self.best)
        return _HYSTERESIS if rose and cheaper else _RETRIAL_HYSTERESIS

    def _cost_rank(self, option: int) -> int:
        """0 for a chain, then the trees from the smallest (the ladder's last) to the largest."""
        return 0 if option == CHAIN else self.options - option

    def _next_loser(self, allowed: set[int]) -> int:
        """The option after the last retried one among ``allowed``, skipping the best (the
        best itself when there is no other)."""
        option = self.retried
        for _ in range(self.options):
            option = (option + 1) % self.options
            if option != self.best and option in allowed:
                self.retried = option
                return option
        return self.best

    def _fold(self, number: int) -> None:
        """Phase ``number``, whose rounds are back: its tokens over its seconds into its
        option's figure (a figure of another load is replaced, not smoothed); too few rounds:
        tried again."""
        record = self.phases.pop(number, None)
        if record is None or record.void:
            return
        option = record.option
        if record.counted < _TRIALS:
            if option not in self.goodput:
                self.tried.discard(option)
            return
        rate, old = record.tokens / record.seconds, self.goodput.get(option)
        if old is not None and not self._stale(option, record.concurrency):
            rate = old + _SMOOTHING * (rate - old)
        self.goodput[option], self.load[option] = rate, record.concurrency
        self.taken[option] = number

    def _may_win_now(self, option: int) -> bool:
        """Whether ``option``'s figure is stale and the load moved so that it could now beat
        the favoured one. A round's time grows with the rounds in flight, at most in
        proportion, so a load m times lower raises a figure at most m times and a load m
        times higher lowers it at most m times: an option that lost by more than that cannot
        have overtaken (trees at half the chains' rate on a CPU target at --concurrency 8
        were re-tried each time its sessions came and went)."""
        if not self._stale(option):
            return False
        now = max(self.concurrency, 1.0)
        rises = max(self.load.get(option, now), 1.0) / now  # > 1: the load fell since
        falls = now / max(self.load.get(self.best, now), 1.0)  # > 1: the load rose since
        return self.goodput[option] * max(rises, 1.0) * max(falls, 1.0) > self.goodput[self.best]

    def _stale(self, option: int, now: float | None = None) -> bool:
        """Whether that option's figure was taken under another load than ``now`` (default:
        the last phase's)."""
        then, now = self.load.get(option), max(self.concurrency if now is None else now, 1.0)
        return then is not None and max(then, now) > _LOAD_CHANGE * max(min(then, now), 1.0)

    def _filled_by_trees(self, now: float) -> None:
        """The hub became fully loaded in a tree phase: trees lose at this load (a full hub
        drafts chains, whose rounds cost it less), whatever their rounds so far say. The phase
        ends; trees wait for their next retry, and are measured anew then."""
        if self.best or not self.decided:
            log.info("token trees off: they fill the hub")
        self.goodput = {o: rate for o, rate in self.goodput.items() if o == CHAIN}
        for record in self.phases.values():
            record.void = record.void or record.option != CHAIN
        self.best, self.decided, self.awaiting = CHAIN, True, None
        self._next_phase(now)
        self.phases[self.phase].option = CHAIN

    def _compare(self, margin: float, others: Sequence[int]) -> None:
        """Keep the favoured option unless one of ``others`` is better by ``margin`` (logged
        when it turns)."""
        was, rates = self.best, self.goodput
        challenger = max(others, key=rates.__getitem__, default=was)
        if rates[challenger] > rates[was] * (1 + margin):
            self.best = challenger
            self.retry_every, self.phases_since_retry = _RETRY_EVERY, 0
        if self.best != was or not self.decided:
            self.decided = True
            figures = ", ".join(f"{_name(o)} {rate:.1f}" for o, rate in sorted(rates.items()))
            log.info("round shape %s (tokens/s a session: %s)", _name(self.best), figures)


def _name(option: int) -> str:
    return "chain" if option == CHAIN else f"tree {option}"
