"""StarSD wire protocol: typed, versioned messages; pure encode/decode, no transport.

A message is a list of frames. Frame 0 is the header: one version byte, one type byte, then a
msgpack map (the body). Arrays never go inside msgpack: each travels as its own raw frame
(C-contiguous bytes), described in the body under ``"arrays"`` as ``[name, dtype, shape]`` in
frame order. Decoding is hardened: frame sizes, msgpack container limits, a schema per message
type, allowed dtypes, and ``len(frame) == prod(shape) * itemsize`` are all checked before any
array is built, and every array view is read-only and zero-copy over the received buffer.

This module imports only msgpack and numpy, so any tool can speak the protocol.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeAlias

import msgpack
import numpy as np

PROTOCOL_VERSION = 2
# a peer silent for this many heartbeat intervals is presumed dead; hub lease, client and ZMTP
# heartbeat timeout all use it
LIVENESS_INTERVALS = 3
MAX_APPENDED = 1024  # tokens a target may commit between two rounds (one DRAFT)
EPOCH_BYTES = 8  # random per hub process; every hub reply carries it
TAG_BYTES = 16  # 128 random bits, minted by the hub
MAX_HEADER_BYTES = 64 * 1024
MAX_FRAME_BYTES = 16 * 1024 * 1024  # one array frame (a dense [gamma, V] float32 fits easily)
MAX_FRAMES = 8
MAX_ARRAY_ELEMENTS = MAX_FRAME_BYTES
ALLOWED_DTYPES = frozenset({"int32", "int64", "float16", "float32"})
_MAX_STR, _MAX_BIN, _MAX_ARRAY, _MAX_MAP = 4096, 1024, 64, 32


class ErrorCode:
    """Error codes carried by :class:`Error` (strings, so logs and clients read them as-is)."""

    MALFORMED = "MALFORMED"
    VERSION_MISMATCH = "VERSION_MISMATCH"
    TOO_LARGE = "TOO_LARGE"
    INCOMPATIBLE = "INCOMPATIBLE"
    NOT_WELCOMED = "NOT_WELCOMED"
    UNKNOWN_SESSION = "UNKNOWN_SESSION"
    FORBIDDEN = "FORBIDDEN"
    OUT_OF_ORDER = "OUT_OF_ORDER"
    BUSY = "BUSY"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    CONTEXT_FULL = "CONTEXT_FULL"
    UNEXPECTED = "UNEXPECTED"
    INTERNAL = "INTERNAL"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    UNAUTHENTICATED = "UNAUTHENTICATED"


class ProtocolError(Exception):
    """A frame or message that cannot be accepted; ``code`` is an :class:`ErrorCode` value."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class SamplingParams:
    """Sampling semantics shared by draft (q) and target (p); temperature 0 means greedy."""

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
        """Raise ProtocolError(INVALID_ARGUMENT) for values no sampler can honour."""
        ok = (
            math.isfinite(self.temperature)
            and 0.0 <= self.temperature <= 100.0
            and 0 <= self.top_k <= 1 << 20
            and 0.0 < self.top_p <= 1.0
            and (self.seed is None or 0 <= self.seed < 1 << 63)
        )
        if not ok:
            raise ProtocolError(ErrorCode.INVALID_ARGUMENT, f"bad sampling parameters {self}")


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


@dataclass(frozen=True)
class Open:
    """Target -> hub: start a session for one sequence; ``ref`` is the target's own handle."""

    TYPE: ClassVar[int] = 3
    ref: int
    prompt: np.ndarray = field(repr=False)  # [n_prompt] int32 token ids
    sampling: SamplingParams
    gamma: int
    # EAGLE hubs only: [n_prompt - 1, H] target features of every prompt position but the last
    features: np.ndarray | None = field(default=None, repr=False)


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
    appended: np.ndarray = field(repr=False)  # [n_appended] int32
    # EAGLE hubs only: [accepted + n_appended, H] features of the positions committed since the
    # last message, up to but excluding the new last token (the target has not run it yet)
    features: np.ndarray | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Proposal:
    """Hub -> target: gamma draft tokens and what the target needs to verify them.

    Greedy: no probabilities. Truncated sampling (top-k/top-p): ``q_support`` [gamma, K] int32
    token ids with ``q_probs`` [gamma, K] float32 (zero-padded). Otherwise dense ``q_probs``
    [gamma, V] float32.
    """

    TYPE: ClassVar[int] = 6
    tag: bytes
    seq: int
    tokens: np.ndarray = field(repr=False)  # [gamma] int32
    q_probs: np.ndarray | None = field(default=None, repr=False)
    q_support: np.ndarray | None = field(default=None, repr=False)
    epoch: bytes = b""


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
    """Answer to PING; from a hub it carries the hub's epoch."""

    TYPE: ClassVar[int] = 9
    nonce: int
    epoch: bytes = b""


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
    """Hub -> asker: hub-wide counters since start (times in seconds)."""

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


Message: TypeAlias = (
    Hello | Welcome | Open | Opened | Draft | Proposal | Close | Ping | Pong | Error
    | StatsRequest | Stats
)
MESSAGE_TYPES: dict[int, type] = {
    cls.TYPE: cls
    for cls in (
        Hello, Welcome, Open, Opened, Draft, Proposal, Close, Ping, Pong, Error, StatsRequest,
        Stats,
    )
}  # fmt: skip

def compatibility_problems(welcome: Welcome, hello: Hello) -> str:
    """What differs between hub and target that makes token ids mean different things ('' if
    nothing). Both sides run it: the hub on HELLO, the target on WELCOME."""
    problems = []
    if hello.vocab_size != welcome.vocab_size:
        problems.append(f"vocab_size differs (hub {welcome.vocab_size}, target {hello.vocab_size})")
    if hello.tokenizer != welcome.tokenizer:
        problems.append(f"tokenizer differs (hub {welcome.tokenizer}, target {hello.tokenizer})")
    if welcome.feature_width and hello.feature_width != welcome.feature_width:
        offered = f"width {hello.feature_width}" if hello.feature_width else "none"
        problems.append(f"the hub drafts with {welcome.draft_kind} and needs target features of "
                        f"width {welcome.feature_width}; the target offers {offered}")
    return "; ".join(problems)


# Schema: for every field, the accepted python types after msgpack decoding. Array fields are
# listed separately with their allowed dtypes and rank.
_INT = (int,)
_OPT_INT = (int, type(None))
_NUM = (float, int)
_SCHEMAS: dict[type, dict[str, tuple[type, ...]]] = {
    Hello: {"model": (str,), "vocab_size": _INT, "tokenizer": (str,), "version": _INT,
            "feature_width": _INT},
    Welcome: {
        "model": (str,), "vocab_size": _INT, "tokenizer": (str,), "epoch": (bytes,),
        "default_gamma": _INT, "max_gamma": _INT, "draft_kind": (str,), "heartbeat_ms": _INT,
        "version": _INT, "feature_width": _INT, "feature_dtype": (str,),
    },
    Open: {"ref": _INT, "sampling": (dict,), "gamma": _INT},
    Opened: {"ref": _INT, "tag": (bytes,), "epoch": (bytes,)},
    Draft: {"tag": (bytes,), "seq": _INT, "accepted": _INT},
    Proposal: {"tag": (bytes,), "seq": _INT, "epoch": (bytes,)},
    Close: {"tag": (bytes,)},
    Ping: {"nonce": _INT},
    Pong: {"nonce": _INT, "epoch": (bytes,)},
    Error: {
        "code": (str,), "message": (str,), "ref": _OPT_INT,
        "tag": (bytes, type(None)), "seq": _OPT_INT, "epoch": (bytes,),
    },
    StatsRequest: {"nonce": _INT},
    Stats: {
        "nonce": _INT, "wall_s": _NUM, "busy_s": _NUM, "jobs": _INT, "batches": _INT,
        "sessions": _INT, "targets": _INT, "rounds": _INT, "proposed": _INT, "accepted": _INT,
        "queue_wait_s": _NUM, "epoch": (bytes,),
    },
}  # fmt: skip
_ARRAYS: dict[type, dict[str, tuple[frozenset[str], int, bool]]] = {
    # name: (dtypes, rank, required)
    Open: {
        "prompt": (frozenset({"int32", "int64"}), 1, True),
        "features": (frozenset({"float16", "float32"}), 2, False),
    },
    Draft: {
        "appended": (frozenset({"int32", "int64"}), 1, True),
        "features": (frozenset({"float16", "float32"}), 2, False),
    },
    Proposal: {
        "tokens": (frozenset({"int32", "int64"}), 1, True),
        "q_probs": (frozenset({"float32", "float16"}), 2, False),
        "q_support": (frozenset({"int32", "int64"}), 2, False),
    },
}
_SAMPLING_SCHEMA = {
    "temperature": (float, int), "top_k": _INT, "top_p": (float, int), "seed": _OPT_INT,
}  # fmt: skip
_DTYPES = {name: np.dtype(name) for name in ALLOWED_DTYPES}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}  # numpy's dtype.name is slow


@dataclass(frozen=True)
class _Layout:
    """What encode and decode need to know about one message class, worked out once: the
    per-message cost of ``dataclasses.fields`` and friends is most of a small message's."""

    header: bytes  # version and type bytes
    body_fields: tuple[str, ...]  # in declaration order; arrays excluded
    array_fields: tuple[str, ...]  # frame order
    defaulted: frozenset[str]  # what a body may leave out
    schema: dict[str, tuple[type, ...]]  # every field a body may carry, with its types


def _layout(cls: type) -> _Layout:
    fields = dataclasses.fields(cls)
    arrays = _ARRAYS.get(cls, {})
    return _Layout(
        header=bytes((PROTOCOL_VERSION, cls.TYPE)),  # type: ignore[attr-defined]
        body_fields=tuple(f.name for f in fields if f.name not in arrays),
        array_fields=tuple(f.name for f in fields if f.name in arrays),
        defaulted=frozenset(f.name for f in fields if f.default is not dataclasses.MISSING),
        schema=_SCHEMAS[cls],
    )


_LAYOUTS = {cls: _layout(cls) for cls in MESSAGE_TYPES.values()}


# ---------------------------------------------------------------------------------- encode


def encode(msg: Message) -> list[bytes | memoryview]:
    """Serialise a message into frames: header (version, type, msgpack body) + array frames."""
    layout = _LAYOUTS[type(msg)]
    body: dict[str, Any] = {name: getattr(msg, name) for name in layout.body_fields}
    if "sampling" in body:
        body["sampling"] = dataclasses.asdict(body["sampling"])
    frames: list[bytes | memoryview] = []
    arrays: list[list[Any]] = []
    for name in layout.array_fields:
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
    body = _unpack_body(header[2:])
    arrays = _decode_arrays(cls, body.pop("arrays", None), frames[1:])
    kwargs = _check_fields(cls, body)
    if "sampling" in kwargs:
        kwargs["sampling"] = _sampling(kwargs["sampling"])
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
            raw, raw=False, strict_map_key=True, max_str_len=_MAX_STR, max_bin_len=_MAX_BIN,
            max_array_len=_MAX_ARRAY, max_map_len=_MAX_MAP, max_ext_len=0,
        )  # fmt: skip
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"body is not valid msgpack: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.MALFORMED, "body is not a map")
    return body


def _check_fields(cls: type, body: dict[str, Any]) -> dict[str, Any]:
    layout = _LAYOUTS[cls]
    if not layout.schema.keys() >= body.keys():
        unknown = _sorted_keys(body.keys() - layout.schema.keys())
        raise ProtocolError(ErrorCode.MALFORMED, f"{cls.__name__}: unknown {unknown}")
    for name, types in layout.schema.items():
        if name in body:
            _check_type(cls.__name__, name, body[name], types)
        elif name not in layout.defaulted:
            raise ProtocolError(ErrorCode.MALFORMED, f"{cls.__name__}: missing field {name!r}")
    return body


def _sorted_keys(keys: Any) -> list[Any]:
    # msgpack map keys may be str or bytes (strict_map_key allows both), which do not compare
    return sorted(keys, key=repr)


def _check_type(where: str, name: str, value: Any, types: tuple[type, ...]) -> None:
    # bool is an int subclass in Python; a bool where a count is expected is a schema error.
    if isinstance(value, bool) or not isinstance(value, types):
        raise ProtocolError(
            ErrorCode.MALFORMED, f"{where}.{name}: {type(value).__name__} is not the expected type"
        )
    if isinstance(value, int) and not -(1 << 63) <= value < 1 << 63:
        raise ProtocolError(ErrorCode.MALFORMED, f"{where}.{name}: integer out of range")


def _sampling(raw: dict[str, Any]) -> SamplingParams:
    unknown = set(raw) - set(_SAMPLING_SCHEMA)
    if unknown:
        raise ProtocolError(ErrorCode.MALFORMED, f"sampling: unknown {_sorted_keys(unknown)}")
    for name, types in _SAMPLING_SCHEMA.items():
        if name in raw:
            _check_type("sampling", name, raw[name], types)
    params = SamplingParams(**raw)
    params.validate()
    return params


def _decode_arrays(
    cls: type, described: Any, frames: Sequence[bytes | memoryview]
) -> dict[str, np.ndarray]:
    spec = _ARRAYS.get(cls, {})
    described = [] if described is None else described
    if not isinstance(described, list) or len(described) != len(frames):
        raise ProtocolError(
            ErrorCode.MALFORMED, f"{cls.__name__}: array descriptors do not match the frames"
        )
    out: dict[str, np.ndarray] = {}
    for desc, frame in zip(described, frames, strict=True):
        name, arr = _decode_array(cls.__name__, spec, desc, frame)
        if name in out:
            raise ProtocolError(ErrorCode.MALFORMED, f"{cls.__name__}: array {name!r} repeated")
        out[name] = arr
    missing = [n for n, (_, _, required) in spec.items() if required and n not in out]
    if missing:
        raise ProtocolError(ErrorCode.MALFORMED, f"{cls.__name__}: missing arrays {missing}")
    return out


def _decode_array(
    where: str, spec: dict[str, tuple[frozenset[str], int, bool]], desc: Any, frame: Any
) -> tuple[str, np.ndarray]:
    if not (isinstance(desc, list) and len(desc) == 3 and isinstance(desc[0], str)):
        raise ProtocolError(ErrorCode.MALFORMED, f"{where}: bad array descriptor")
    name, dtype, shape = desc
    if name not in spec:
        raise ProtocolError(ErrorCode.MALFORMED, f"{where}: unexpected array {name!r}")
    dtypes, rank, _ = spec[name]
    if not isinstance(dtype, str) or dtype not in dtypes or dtype not in ALLOWED_DTYPES:
        raise ProtocolError(ErrorCode.MALFORMED, f"{where}.{name}: dtype {dtype!r} not allowed")
    if not _valid_shape(shape, rank):
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
