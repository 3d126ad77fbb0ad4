"""StarSD wire protocol, its messages: the schema, its one source.

Each message is a dataclass: a field's annotation says which types its value may have on the
wire, a default makes it optional, and an array field carries its dtypes and rank in its
metadata (see :func:`array_field`). A body field marked ``sparse`` in its metadata is left out
while it holds its default, so a peer that predates the field still reads every message that
does not use it (decoders refuse unknown keys). :mod:`starsd.protocol` derives its encode and
decode tables from these classes once, at import, and is where every other module takes them
from. Also here: the rules both ends apply to a handshake (:func:`compatibility_problems`,
:func:`feature_taps`).

This module imports only the standard library, numpy and its leaf ``starsd.params``.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, TypeAlias

import numpy as np

from starsd.limits import MAX_TIMING_US
from starsd.params import SamplingParams

PROTOCOL_VERSION = 2
# a peer silent for this many heartbeat intervals is presumed dead; hub lease, client and ZMTP
# heartbeat timeout all use it
LIVENESS_INTERVALS = 3
EPOCH_BYTES = 8  # random per hub process; every hub reply carries it
TAG_BYTES = 16  # 128 random bits, minted by the hub
ALLOWED_DTYPES = frozenset({"int32", "int64", "float16", "float32"})
_IDS = frozenset({"int32", "int64"})
_FLOATS = frozenset({"float16", "float32"})
_INT32, _INT64, _FLOAT32 = frozenset({"int32"}), frozenset({"int64"}), frozenset({"float32"})


@dataclass(frozen=True)
class ArraySpec:
    dtypes: frozenset[str]
    rank: int
    group: str = ""  # arrays of one group come all or none, with equal first dimensions


def array_field(dtypes: frozenset[str], rank: int, group: str = "") -> dict[str, ArraySpec]:
    """Field metadata marking a numpy array that travels as its own raw frame, of one of
    ``dtypes`` and with ``rank`` dimensions (a default of None makes it optional). Arrays that
    share a ``group`` are columns of one table: decode refuses a message with only some of them,
    or with first dimensions that differ."""
    if not dtypes <= ALLOWED_DTYPES:  # decode builds arrays only from the dtypes it knows
        raise ValueError(f"dtypes {sorted(dtypes - ALLOWED_DTYPES)} are not allowed")
    if group and rank < 1:  # a group's arrays are compared by their first dimension
        raise ValueError("a grouped array needs a first dimension")
    return {"array": ArraySpec(dtypes, rank, group)}


# ---------------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Hello:
    """Target -> hub, first message on a connection: what the target runs."""

    TYPE: ClassVar[int] = 1
    model: str
    vocab_size: int
    tokenizer: str  # tokenizer fingerprint (see starsd.models.tokenizer_fingerprint)
    version: int = PROTOCOL_VERSION
    feature_width: int = 0  # hidden size of the features the target can send (0: none)
    # > 0: the target verifies token trees of up to this many nodes (Proposal.parents); 0 or
    # absent (older targets): chains only
    tree_nodes: int = field(default=0, metadata={"sparse": True})


@dataclass(frozen=True)
class Welcome:
    """Hub -> target: the hub accepted HELLO; what it serves and its limits."""

    TYPE: ClassVar[int] = 2
    model: str
    vocab_size: int
    tokenizer: str
    epoch: bytes  # random per hub process: a new epoch means the hub restarted
    default_gamma: int
    max_gamma: int
    draft_kind: str = "llm"
    heartbeat_ms: int = 1000  # send something at least this often (see LIVENESS_INTERVALS)
    version: int = PROTOCOL_VERSION
    feature_width: int = 0  # > 0: the hub drafts from target features (EAGLE) of this width
    feature_dtype: str = "float16"  # and expects them in this dtype
    # The hidden states a feature row holds, side by side: "" the target's last (EAGLE-1's),
    # else comma-separated layer indices (EAGLE-3's three; see feature_taps). Sparse: sent by
    # hubs that draft from other layers only.
    feature_layers: str = field(default="", metadata={"sparse": True})
    # The hub's load when it answered (WELCOME and PONG from a hub; targets place new sessions
    # on the hub holding the fewest sessions, edge.hubs). Sparse: absent from older hubs.
    sessions: int = field(default=0, metadata={"sparse": True})  # open sessions, all targets
    queue: int = field(default=0, metadata={"sparse": True})  # draft jobs waiting in Q_in
    busy: float = field(default=0.0, metadata={"sparse": True})  # drafting busy fraction, last ~2 s
    # pushed branches per round this hub sends to a session that asks (Open.push); 0 or absent
    # (older hubs, whose OPEN decoder would refuse the field): a target must not ask
    push: int = field(default=0, metadata={"sparse": True})
    # > 0: this hub may propose token trees of up to min(this, Hello.tree_nodes) nodes to a
    # target that announced them; 0 or absent: chains only
    tree_nodes: int = field(default=0, metadata={"sparse": True})


@dataclass(frozen=True)
class Open:
    """Target -> hub: start a session for one sequence; ``ref`` is the target's own handle."""

    TYPE: ClassVar[int] = 3
    ref: int
    prompt: np.ndarray = field(repr=False, metadata=array_field(_IDS, 1))  # [n_prompt] token ids
    sampling: SamplingParams
    gamma: int
    # EAGLE hubs only: [n_prompt - 1, H] target features of every prompt position but the last
    features: np.ndarray | None = field(default=None, repr=False, metadata=array_field(_FLOATS, 2))
    # > 0: the target takes up to this many pushed branches per round (conditional PROPOSALs,
    # see Proposal.if_accepted); 0 or absent: proposals only when asked (older targets)
    push: int = field(default=0, metadata={"sparse": True})


@dataclass(frozen=True)
class Opened:
    """Hub -> target: the session tag minted for OPEN ``ref``; PROPOSAL seq 0 follows."""

    TYPE: ClassVar[int] = 4
    ref: int
    tag: bytes
    epoch: bytes = b""


@dataclass(frozen=True)
class Draft:
    """Target -> hub: verdict on proposal ``seq - 1`` and request for proposal ``seq``.

    ``accepted`` draft tokens of the previous proposal were kept, then ``appended`` tokens
    (the corrected or bonus token) were committed after them.
    """

    TYPE: ClassVar[int] = 5
    tag: bytes
    seq: int
    accepted: int
    appended: np.ndarray = field(repr=False, metadata=array_field(_IDS, 1))  # [n_appended]
    # EAGLE hubs only: [accepted + n_appended, H] features of the positions committed since the
    # last message, up to but excluding the new last token (the target has not run it yet)
    features: np.ndarray | None = field(default=None, repr=False, metadata=array_field(_FLOATS, 2))
    # > 0: the target already holds proposal ``seq``, the pushed branch for exactly this verdict
    # (``taken`` tokens), and is verifying it: the hub commits that branch and sends nothing
    taken: int = field(default=0, metadata={"sparse": True})
    # The verdict on a token tree (Proposal.parents): [accepted] the accepted path's node
    # indices, root side first; absent after a chain (its path is its first ``accepted`` tokens)
    path: np.ndarray | None = field(default=None, repr=False, metadata=array_field(_IDS, 1))
    # Microseconds the target's model spent on forwards that did not carry this sequence
    # between proposal seq - 1 arriving and this DRAFT (other sequences' prefills, and steps or
    # verifications of rows that were not batched with it): time that this sequence's gamma
    # does not change, which the hub leaves out of the round trip it prices gammas by
    # (0..MAX_TIMING_US)
    others_us: int = field(default=0, metadata={"sparse": True})
    # The mean microseconds of the target's own forwards that carried this sequence meanwhile
    # (the verification of proposal seq - 1; after a span alone, its steps); 0: not measured.
    # Beside the gamma of each, they tell the hub what one more draft token costs the target
    # without the link's and the queues' noise
    forward_us: int = field(default=0, metadata={"sparse": True})


def timing_us(seconds: float) -> int:
    """A DRAFT's time field (Draft.others_us, forward_us): whole microseconds, within the
    0..MAX_TIMING_US a hub accepts."""
    return min(max(round(seconds * 1e6), 0), MAX_TIMING_US)


@dataclass(frozen=True)
class Proposal:
    """Hub -> target: gamma draft tokens and what the target needs to verify them.

    Greedy: no probabilities. Truncated sampling (top-k/top-p): ``q_support`` [gamma, K] int32
    token ids with ``q_probs`` [gamma, K] float32 (zero-padded). Otherwise dense ``q_probs``
    [gamma, V] float32.

    ``alone`` > 0 comes with no tokens (gamma 0: speculation does not pay for this sequence
    now): the target decodes that many tokens itself (fewer if it stops first), then sends its
    DRAFT with accepted 0 and those tokens appended.

    A *pushed branch* (``if_accepted`` >= 0, sessions opened with ``push``) is proposal ``seq``
    drafted ahead, before the verdict on ``seq - 1`` exists: it holds only if that verdict is
    ``accepted = if_accepted`` with the one token ``if_appended`` appended. A target whose verdict
    matches verifies it at once and sends its DRAFT with ``taken`` = len(tokens); otherwise it
    drops the branch and asks as usual. Its tokens and q are exactly what the hub would draft
    after that verdict, so verifying it is as lossless as an asked-for proposal.

    A *token tree* (``parents`` given, to a target that announced ``Hello.tree_nodes``): node i
    is ``tokens[i]`` with parent node ``parents[i]`` (-1: a child of the last committed token),
    parents before children, siblings distinct and in drawing order; q row i is the law node i
    was drawn from (its parent's, the same for siblings: drawn one after another without
    replacement). The DRAFT answering it names the accepted path (``Draft.path``). A tree is
    never a pushed branch.
    """

    TYPE: ClassVar[int] = 6
    tag: bytes
    seq: int
    tokens: np.ndarray = field(repr=False, metadata=array_field(_IDS, 1))  # [gamma]
    q_probs: np.ndarray | None = field(default=None, repr=False, metadata=array_field(_FLOATS, 2))
    q_support: np.ndarray | None = field(default=None, repr=False, metadata=array_field(_IDS, 2))
    epoch: bytes = b""
    # tokens to decode alone before the next DRAFT (with no tokens only); sent only when > 0
    alone: int = field(default=0, metadata={"sparse": True})
    # a pushed branch: the verdict on seq - 1 it is drafted after (-1: an asked-for proposal)
    if_accepted: int = field(default=-1, metadata={"sparse": True})
    if_appended: int = field(default=-1, metadata={"sparse": True})
    # [gamma] int32 parent node of each token (a token tree; None: a chain)
    parents: np.ndarray | None = field(default=None, repr=False, metadata=array_field(_IDS, 1))

    @property
    def branch(self) -> tuple[int, int] | None:
        """The verdict (accepted, appended token) a pushed branch holds for; None if asked for."""
        return None if self.if_accepted < 0 else (self.if_accepted, self.if_appended)


@dataclass(frozen=True)
class Close:
    """Target -> hub: the sequence is finished; free its draft state."""

    TYPE: ClassVar[int] = 7
    tag: bytes


@dataclass(frozen=True)
class Ping:
    """Liveness probe, either direction; answered by PONG with the same nonce."""

    TYPE: ClassVar[int] = 8
    nonce: int


@dataclass(frozen=True)
class Pong:
    """Answer to PING; from a hub it carries the hub's epoch and load."""

    TYPE: ClassVar[int] = 9
    nonce: int
    epoch: bytes = b""
    # The hub's load when it answered (WELCOME and PONG from a hub; targets place new sessions
    # on the hub holding the fewest sessions, edge.hubs). Sparse: absent from older hubs.
    sessions: int = field(default=0, metadata={"sparse": True})  # open sessions, all targets
    queue: int = field(default=0, metadata={"sparse": True})  # draft jobs waiting in Q_in
    busy: float = field(default=0.0, metadata={"sparse": True})  # drafting busy fraction, last ~2 s


@dataclass(frozen=True)
class Error:
    """Either direction: ``code`` (ErrorCode) and a human message; ref/tag/seq say what failed."""

    TYPE: ClassVar[int] = 10
    code: str
    message: str
    ref: int | None = None
    tag: bytes | None = None
    seq: int | None = None
    epoch: bytes = b""


@dataclass(frozen=True)
class StatsRequest:
    """Target (or a monitoring tool) -> hub: ask for the hub's counters."""

    TYPE: ClassVar[int] = 11
    nonce: int


@dataclass(frozen=True)
class Stats:
    """Hub -> asker: hub-wide counters since start (times in seconds).

    The service curve S(B), one row per batch size drafted so far (sorted): ``batch_sizes`` B,
    ``batch_counts`` batches of that size, ``batch_busy_s`` their summed wall seconds (the mean
    is busy / count). Totals rather than means so that two snapshots subtract. None from a hub
    that predates the curve; all three or none, of equal length (decode checks).
    """

    TYPE: ClassVar[int] = 12
    nonce: int
    wall_s: float
    busy_s: float  # drafting thread busy time
    jobs: int
    batches: int
    sessions: int
    targets: int
    rounds: int
    proposed: int
    accepted: int
    queue_wait_s: float
    epoch: bytes = b""
    batch_sizes: np.ndarray | None = field(
        default=None, repr=False, metadata=array_field(_INT32, 1, "curve")
    )
    batch_counts: np.ndarray | None = field(
        default=None, repr=False, metadata=array_field(_INT64, 1, "curve")
    )
    # float32, not float64: the wire's dtypes (ALLOWED_DTYPES) have no float64. The hub sums in
    # double and rounds once here, 24 bits of mantissa: a relative error under 1e-7 of a total,
    # far below the run-to-run noise of S(B).
    batch_busy_s: np.ndarray | None = field(
        default=None, repr=False, metadata=array_field(_FLOAT32, 1, "curve")
    )

    def service_totals(self) -> list[tuple[int, int, float]]:
        """The curve's rows: (batch size, batches, summed wall seconds); [] without a curve."""
        if self.batch_sizes is None or self.batch_counts is None or self.batch_busy_s is None:
            return []
        columns = (
            self.batch_sizes.tolist(),
            self.batch_counts.tolist(),
            self.batch_busy_s.tolist(),
        )
        return list(zip(*columns, strict=True))


class CurveArrays(typing.TypedDict):
    """Stats' three curve fields, by name (a TypedDict, so ``**`` them into Stats type-checks)."""

    batch_sizes: np.ndarray
    batch_counts: np.ndarray
    batch_busy_s: np.ndarray


def curve_arrays(totals: Sequence[tuple[int, int, float]]) -> CurveArrays:
    """Stats' curve fields from (batch size, batches, summed seconds) rows, as
    ``HubStats.service_totals()`` gives them: ``Stats(..., **curve_arrays(rows))``."""
    sizes, counts, seconds = zip(*totals, strict=True) if totals else ((), (), ())
    return CurveArrays(
        batch_sizes=np.array(sizes, np.int32),
        batch_counts=np.array(counts, np.int64),
        batch_busy_s=np.array(seconds, np.float32),
    )


Message: TypeAlias = (
    Hello
    | Welcome
    | Open
    | Opened
    | Draft
    | Proposal
    | Close
    | Ping
    | Pong
    | Error
    | StatsRequest
    | Stats
)
MESSAGE_TYPES: dict[int, type] = {cls.TYPE: cls for cls in typing.get_args(Message)}


MAX_FEATURE_LAYERS = 8  # hidden states one feature row may hold


def feature_taps(welcome: Welcome) -> tuple[int, ...]:
    """The hidden states a hub drafts from, as :func:`starsd.llama.tapped` indexes them: ()
    for none, (-1,) for the last (EAGLE-1), else WELCOME's layer list. ValueError for a list
    that is not up to MAX_FEATURE_LAYERS distinct indices in 0..4095."""
    if not welcome.feature_width:
        return ()
    if not welcome.feature_layers:
        return (-1,)
    parts = welcome.feature_layers.split(",")
    if len(parts) > MAX_FEATURE_LAYERS or not all(p.isdigit() and len(p) <= 4 for p in parts):
        raise ValueError(
            f"feature layers {welcome.feature_layers[:64]!r}: want up to "
            f"{MAX_FEATURE_LAYERS} comma-separated indices"
        )
    taps = tuple(int(p) for p in parts)
    if len(set(taps)) != len(taps):
        raise ValueError(f"feature layers {welcome.feature_layers!r} repeat an index")
    return taps


def compatibility_problems(welcome: Welcome, hello: Hello) -> str:
    """What differs between hub and target that makes token ids mean different things ('' if
    nothing). Both sides run it: the hub on HELLO, the target on WELCOME."""
    problems = []
    if hello.vocab_size != welcome.vocab_size:
        problems.append(f"vocab_size differs (hub {welcome.vocab_size}, target {hello.vocab_size})")
    if hello.tokenizer != welcome.tokenizer:
        problems.append(f"tokenizer differs (hub {welcome.tokenizer}, target {hello.tokenizer})")
    problem = _feature_problem(welcome, hello)
    if problem:
        problems.append(problem)
    return "; ".join(problems)


def _feature_problem(welcome: Welcome, hello: Hello) -> str:
    """Why the target cannot send the features the hub drafts from ('' if it can): each
    hidden state is ``hello.feature_width`` wide, a row holds one per tap."""
    try:
        taps = feature_taps(welcome)
    except ValueError as exc:
        return str(exc)
    if taps and hello.feature_width * len(taps) != welcome.feature_width:
        offered = f"width {hello.feature_width}" if hello.feature_width else "none"
        return (
            f"the hub drafts with {welcome.draft_kind} and needs target features of width "
            f"{welcome.feature_width} ({len(taps)} hidden states); the target offers {offered}"
        )
    return ""
