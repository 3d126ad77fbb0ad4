"""StarSD wire protocol: typed, versioned messages; pure encode/decode, no transport.

A message is a list of frames. Frame 0 is the header: one version byte, one type byte, then a
msgpack map (the body). Arrays never go inside msgpack: each travels as its own raw frame
(C-contiguous bytes), described in the body under ``"arrays"`` as ``[name, dtype, shape]`` in
frame order. Decoding is hardened: frame sizes, msgpack container limits, a schema per message
type, allowed dtypes, and ``len(frame) == prod(shape) * itemsize`` are all checked before any
array is built, and every array view is read-only and zero-copy over the received buffer.
Arrays that only mean something together (a group, such as STATS' service curve) must arrive all
or none, with equal first dimensions.

The message dataclasses are the schema, its one source: a field's annotation says which types
its value may have on the wire, a default makes it optional, and an array field carries its
dtypes and rank in its metadata (see ``_array``). A body field marked ``sparse`` in its metadata
is left out while it holds its default, so a peer that predates the field still reads every
message that does not use it (decoders refuse unknown keys). The tables that encode and decode
read are derived from them once, at import.

This module imports only the standard library, msgpack, numpy and its three leaves
(``starsd.errors``, ``starsd.params``, ``starsd.limits``), so any tool can speak it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field
from typing import Any, ClassVar, TypeAlias

import msgpack
import numpy as np

# (the wire's names for these: protocol.ErrorCode, protocol.ProtocolError, protocol.SamplingParams)
from starsd.errors import ErrorCode, ProtocolError
from starsd.limits import (  # the wire's size limits (their one home: starsd.limits)
    MAX_ARRAY_ELEMENTS,
    MAX_FRAME_BYTES,
    MAX_FRAMES,
    MAX_HEADER_BYTES,
)
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
_MAX_STR, _MAX_BIN, _MAX_ARRAY, _MAX_MAP = 4096, 1024, 64, 32


@dataclass(frozen=True)
class _ArraySpec:
    dtypes: frozenset[str]
    rank: int
    group: str = ""  # arrays of one group come all or none, with equal first dimensions


def _array(dtypes: frozenset[str], rank: int, group: str = "") -> dict[str, _ArraySpec]:
    """Field metadata marking a numpy array that travels as its own raw frame, of one of
    ``dtypes`` and with ``rank`` dimensions (a default of None makes it optional). Arrays that
    share a ``group`` are columns of one table: decode refuses a message with only some of them,
    or with first dimensions that differ."""
    if not dtypes <= ALLOWED_DTYPES:  # decode builds arrays only from the dtypes it knows
        raise ValueError(f"dtypes {sorted(dtypes - ALLOWED_DTYPES)} are not allowed")
    if group and rank < 1:  # a group's arrays are compared by their first dimension
        raise ValueError("a grouped array needs a first dimension")
    return {"array": _ArraySpec(dtypes, rank, group)}


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
    # on the hub with the most spare capacity, edge.hubs). Sparse: absent from older hubs.
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
    prompt: np.ndarray = field(repr=False, metadata=_array(_IDS, 1))  # [n_prompt] token ids
    sampling: SamplingParams
    gamma: int
    # EAGLE hubs only: [n_prompt - 1, H] target features of every prompt position but the last
    features: np.ndarray | None = field(default=None, repr=False, metadata=_array(_FLOATS, 2))
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
    appended: np.ndarray = field(repr=False, metadata=_array(_IDS, 1))  # [n_appended]
    # EAGLE hubs only: [accepted + n_appended, H] features of the positions committed since the
    # last message, up to but excluding the new last token (the target has not run it yet)
    features: np.ndarray | None = field(default=None, repr=False, metadata=_array(_FLOATS, 2))
    # > 0: the target already holds proposal ``seq``, the pushed branch for exactly this verdict
    # (``taken`` tokens), and is verifying it: the hub commits that branch and sends nothing
    taken: int = field(default=0, metadata={"sparse": True})
    # The verdict on a token tree (Proposal.parents): [accepted] the accepted path's node
    # indices, root side first; absent after a chain (its path is its first ``accepted`` tokens)
    path: np.ndarray | None = field(default=None, repr=False, metadata=_array(_IDS, 1))


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
    tokens: np.ndarray = field(repr=False, metadata=_array(_IDS, 1))  # [gamma]
    q_probs: np.ndarray | None = field(default=None, repr=False, metadata=_array(_FLOATS, 2))
    q_support: np.ndarray | None = field(default=None, repr=False, metadata=_array(_IDS, 2))
    epoch: bytes = b""
    # tokens to decode alone before the next DRAFT (with no tokens only); sent only when > 0
    alone: int = field(default=0, metadata={"sparse": True})
    # a pushed branch: the verdict on seq - 1 it is drafted after (-1: an asked-for proposal)
    if_accepted: int = field(default=-1, metadata={"sparse": True})
    if_appended: int = field(default=-1, metadata={"sparse": True})
    # [gamma] int32 parent node of each token (a token tree; None: a chain)
    parents: np.ndarray | None = field(default=None, repr=False, metadata=_array(_IDS, 1))

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
    # on the hub with the most spare capacity, edge.hubs). Sparse: absent from older hubs.
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
        default=None, repr=False, metadata=_array(_INT32, 1, "curve")
    )
    batch_counts: np.ndarray | None = field(
        default=None, repr=False, metadata=_array(_INT64, 1, "curve")
    )
    # float32, not float64: the wire's dtypes (ALLOWED_DTYPES) have no float64. The hub sums in
    # double and rounds once here, 24 bits of mantissa: a relative error under 1e-7 of a total,
    # far below the run-to-run noise of S(B).
    batch_busy_s: np.ndarray | None = field(
        default=None, repr=False, metadata=_array(_FLOAT32, 1, "curve")
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


# --------------------------------------------------------------------------- derived schema

# The types a msgpack value may decode into, per type a field may be annotated with: exact
# types (``type(v) in``), so a bool, an int subclass, is never taken for a count. A float may
# arrive as an int, as packers in other languages send integral floats; a nested dataclass
# (SamplingParams) arrives as a map.
_WIRE_TYPES: dict[Any, frozenset[type]] = {
    int: frozenset({int}),
    float: frozenset({float, int}),
    str: frozenset({str}),
    bytes: frozenset({bytes}),
    type(None): frozenset({type(None)}),
    SamplingParams: frozenset({dict}),
}
_DTYPES = {name: np.dtype(name) for name in ALLOWED_DTYPES}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}  # numpy's dtype.name is slow


@dataclass(frozen=True)
class _Layout:
    """What encode and decode need to know about one dataclass, worked out once: the
    per-message cost of ``dataclasses.fields`` and friends is most of a small message's."""

    name: str  # for error messages
    header: bytes  # version and type bytes
    schema: dict[str, frozenset[type]]  # body fields in declaration order, with their types
    defaulted: frozenset[str]  # what a message may leave out, body fields or arrays
    nested: tuple[str, ...]  # body fields holding SamplingParams (a map on the wire)
    arrays: dict[str, _ArraySpec]  # array fields, in frame order
    groups: tuple[tuple[str, ...], ...]  # array fields that come all or none, equal lengths
    sparse: tuple[tuple[str, Any], ...] = ()  # body fields left out at their default: (name, it)


def _union(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _layout(cls: type) -> _Layout:
    hints = typing.get_type_hints(cls)  # the annotations are strings (postponed evaluation)
    schema: dict[str, frozenset[type]] = {}
    arrays: dict[str, _ArraySpec] = {}
    for f in dataclasses.fields(cls):
        parts = _union(hints[f.name])
        if "array" in f.metadata and set(parts) <= {np.ndarray, type(None)}:
            arrays[f.name] = f.metadata["array"]
        elif "array" not in f.metadata and all(part in _WIRE_TYPES for part in parts):
            schema[f.name] = frozenset().union(*(_WIRE_TYPES[part] for part in parts))
        else:  # refuse at import what decode could not check, rather than skip it
            raise TypeError(f"{cls.__name__}.{f.name}: no wire form for {hints[f.name]}")
    defaulted = frozenset(
        f.name
        for f in dataclasses.fields(cls)
        if f.default is not MISSING or f.default_factory is not MISSING
    )
    return _Layout(
        name=cls.__name__,
        header=bytes((PROTOCOL_VERSION, getattr(cls, "TYPE", 0))),  # SamplingParams: unused
        schema=schema,
        defaulted=defaulted,
        nested=tuple(n for n in schema if SamplingParams in _union(hints[n])),
        arrays=arrays,
        groups=_groups(arrays),
        sparse=_sparse(cls),
    )


def _sparse(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, default) of the body fields left out while at their default."""
    return tuple((f.name, f.default) for f in dataclasses.fields(cls) if f.metadata.get("sparse"))


def _groups(arrays: dict[str, _ArraySpec]) -> tuple[tuple[str, ...], ...]:
    members: dict[str, list[str]] = {}
    for name, spec in arrays.items():
        if spec.group:
            members.setdefault(spec.group, []).append(name)
    return tuple(tuple(names) for names in members.values())


_LAYOUTS = {cls: _layout(cls) for cls in (*MESSAGE_TYPES.values(), SamplingParams)}
_SAMPLING_FIELDS = tuple(_LAYOUTS[SamplingParams].schema)


# ---------------------------------------------------------------------------------- encode


def encode(msg: Message) -> list[bytes | memoryview]:
    """Serialise a message into frames: header (version, type, msgpack body) + array frames."""
    layout = _LAYOUTS[type(msg)]
    body: dict[str, Any] = {name: getattr(msg, name) for name in layout.schema}
    for name in layout.nested:  # (dataclasses.asdict would deep-copy: slower)
        if body[name] is not None:
            body[name] = {key: getattr(body[name], key) for key in _SAMPLING_FIELDS}
    for name, default in layout.sparse:
        if body[name] == default:
            del body[name]
    frames: list[bytes | memoryview] = []
    arrays: list[list[Any]] = []
    for name in layout.arrays:
        value = getattr(msg, name)
        if value is not None:
            arr = np.ascontiguousarray(value)
            arrays.append([name, _DTYPE_NAMES.get(arr.dtype) or arr.dtype.name, list(arr.shape)])
            # (a zero-size array has no byte view to cast: it travels as an empty frame)
            frames.append(memoryview(arr).cast("B") if arr.size else b"")  # type: ignore[arg-type]
    if arrays:
        body["arrays"] = arrays
    return [layout.header + msgpack.packb(body, use_bin_type=True), *frames]


# ---------------------------------------------------------------------------------- decode


def decode(frames: Sequence[Any]) -> Message:
    """Parse frames into a message, raising ProtocolError for anything malformed."""
    if not frames:
        raise ProtocolError(ErrorCode.MALFORMED, "empty message")
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{len(frames)} frames (max {MAX_FRAMES})")
    header = memoryview(frames[0])
    cls = _header_type(header)
    layout = _LAYOUTS[cls]
    body = _unpack_body(header[2:])
    arrays = _decode_arrays(layout, body.pop("arrays", None), frames[1:])
    kwargs = _check_fields(layout, body)
    for name in layout.nested:
        if kwargs.get(name) is not None:
            kwargs[name] = _sampling(kwargs[name])
    return cls(**kwargs, **arrays)  # type: ignore[no-any-return]


def _header_type(header: memoryview) -> type:
    if len(header) < 3:
        raise ProtocolError(ErrorCode.MALFORMED, f"header of {len(header)} bytes is truncated")
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"header {len(header)} B > {MAX_HEADER_BYTES} B")
    if header[0] != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.VERSION_MISMATCH,
            f"protocol version {header[0]} is not supported (this side speaks {PROTOCOL_VERSION})",
        )
    cls = MESSAGE_TYPES.get(header[1])
    if cls is None:
        raise ProtocolError(ErrorCode.MALFORMED, f"unknown message type {header[1]}")
    return cls


def _unpack_body(raw: memoryview) -> dict[str, Any]:
    try:
        body = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_str_len=_MAX_STR,
            max_bin_len=_MAX_BIN,
            max_array_len=_MAX_ARRAY,
            max_map_len=_MAX_MAP,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"body is not valid msgpack: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.MALFORMED, "body is not a map")
    return body


def _check_fields(layout: _Layout, body: dict[str, Any]) -> dict[str, Any]:
    """Check a decoded map against a layout's schema: known keys, types, nothing missing."""
    schema = layout.schema
    if not schema.keys() >= body.keys():
        # msgpack map keys may be str or bytes (strict_map_key allows both): sort by repr
        unknown = sorted(body.keys() - schema.keys(), key=repr)
        raise ProtocolError(ErrorCode.MALFORMED, f"{layout.name}: unknown {unknown}")
    for name, allowed in schema.items():
        if name in body:
            value = body[name]
            if type(value) not in allowed:
                raise ProtocolError(
                    ErrorCode.MALFORMED,
                    f"{layout.name}.{name}: {type(value).__name__} is not the expected type",
                )
            if type(value) is int and not -(1 << 63) <= value < 1 << 63:
                raise ProtocolError(ErrorCode.MALFORMED, f"{layout.name}.{name}: out of range")
        elif name not in layout.defaulted:
            raise ProtocolError(ErrorCode.MALFORMED, f"{layout.name}: missing field {name!r}")
    return body


def _sampling(raw: dict[str, Any]) -> SamplingParams:
    params = SamplingParams(**_check_fields(_LAYOUTS[SamplingParams], raw))
    params.validate()
    return params


def _decode_arrays(
    layout: _Layout, described: Any, frames: Sequence[bytes | memoryview]
) -> dict[str, np.ndarray]:
    described = [] if described is None else described
    if not isinstance(described, list) or len(described) != len(frames):
        raise ProtocolError(
            ErrorCode.MALFORMED, f"{layout.name}: array descriptors do not match the frames"
        )
    out: dict[str, np.ndarray] = {}
    for desc, frame in zip(described, frames, strict=True):
        name, arr = _decode_array(layout, desc, frame)
        if name in out:
            raise ProtocolError(ErrorCode.MALFORMED, f"{layout.name}: array {name!r} repeated")
        out[name] = arr
    missing = [n for n in layout.arrays if n not in out and n not in layout.defaulted]
    if missing:
        raise ProtocolError(ErrorCode.MALFORMED, f"{layout.name}: missing arrays {missing}")
    for group in layout.groups:
        _check_group(layout.name, group, out)
    return out


def _check_group(where: str, group: tuple[str, ...], arrays: dict[str, np.ndarray]) -> None:
    """Columns of one table: all or none, and as long as each other."""
    present = [name for name in group if name in arrays]
    if present and len(present) != len(group):
        raise ProtocolError(
            ErrorCode.MALFORMED, f"{where}: arrays {list(group)} come together, got only {present}"
        )
    lengths = {name: arrays[name].shape[0] for name in present}
    if len(set(lengths.values())) > 1:
        raise ProtocolError(ErrorCode.MALFORMED, f"{where}: arrays of unequal lengths {lengths}")


def _decode_array(layout: _Layout, desc: Any, frame: Any) -> tuple[str, np.ndarray]:
    where = layout.name
    if not (isinstance(desc, list) and len(desc) == 3 and isinstance(desc[0], str)):
        raise ProtocolError(ErrorCode.MALFORMED, f"{where}: bad array descriptor")
    name, dtype, shape = desc
    spec = layout.arrays.get(name)
    if spec is None:
        raise ProtocolError(ErrorCode.MALFORMED, f"{where}: unexpected array {name!r}")
    # (every spec's dtypes are among ALLOWED_DTYPES: _array checks that at import)
    if not isinstance(dtype, str) or dtype not in spec.dtypes:
        raise ProtocolError(ErrorCode.MALFORMED, f"{where}.{name}: dtype {dtype!r} not allowed")
    if not _valid_shape(shape, spec.rank):
        raise ProtocolError(ErrorCode.MALFORMED, f"{where}.{name}: bad shape {shape!r}")
    buf = memoryview(frame)
    count = math.prod(shape)
    if count > MAX_ARRAY_ELEMENTS or len(buf) > MAX_FRAME_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{where}.{name}: array too large")
    expected = count * _DTYPES[dtype].itemsize
    if len(buf) != expected:
        raise ProtocolError(
            ErrorCode.MALFORMED, f"{where}.{name}: {len(buf)} bytes, shape needs {expected}"
        )
    arr = np.frombuffer(buf, dtype=_DTYPES[dtype]).reshape(shape)
    arr.flags.writeable = False
    return name, arr


def _valid_shape(shape: Any, rank: int) -> bool:
    if not isinstance(shape, list) or len(shape) != rank:
        return False
    # type() is, not isinstance: a bool is an int subclass but no dimension
    return all(type(d) is int and 0 <= d < 1 << 31 for d in shape)
