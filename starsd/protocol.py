"""StarSD wire protocol: typed, versioned messages; pure encode/decode, no transport.

A message is a list of frames. Frame 0 is the header: one version byte, one type byte, then a
msgpack map (the body). Arrays never go inside msgpack: each travels as its own raw frame
(C-contiguous bytes), described in the body under ``"arrays"`` as ``[name, dtype, shape]`` in
frame order. Decoding is hardened: frame sizes, msgpack container limits, a schema per message
type, allowed dtypes, and ``len(frame) == prod(shape) * itemsize`` are all checked before any
array is built, and every array view is read-only and zero-copy over the received buffer.
Arrays that only mean something together (a group, such as STATS' service curve) must arrive all
or none, with equal first dimensions.

The message dataclasses are the schema, its one source (:mod:`starsd.messages`, re-exported
here: every other module takes them from this one); the tables that encode and decode read are
derived from them once, at import.

This module imports only the standard library, msgpack, numpy and its four leaves
(``starsd.messages``, ``starsd.errors``, ``starsd.params``, ``starsd.limits``), so any tool can
speak it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Sequence
from dataclasses import MISSING, dataclass
from typing import Any

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
from starsd.messages import (  # the schema (re-exported: the protocol's public face)
    ALLOWED_DTYPES,
    EPOCH_BYTES,
    LIVENESS_INTERVALS,
    MAX_FEATURE_LAYERS,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    TAG_BYTES,
    ArraySpec,
    Close,
    CurveArrays,
    Draft,
    Error,
    Hello,
    Message,
    Open,
    Opened,
    Ping,
    Pong,
    Proposal,
    Stats,
    StatsRequest,
    Welcome,
    array_field,
    compatibility_problems,
    curve_arrays,
    feature_taps,
    timing_us,
)
from starsd.params import SamplingParams

_MAX_STR, _MAX_BIN, _MAX_ARRAY, _MAX_MAP = 4096, 1024, 64, 32  # msgpack container limits

__all__ = [
    "ALLOWED_DTYPES",
    "EPOCH_BYTES",
    "LIVENESS_INTERVALS",
    "MAX_FEATURE_LAYERS",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "TAG_BYTES",
    "ArraySpec",
    "Close",
    "CurveArrays",
    "Draft",
    "Error",
    "ErrorCode",
    "Hello",
    "Message",
    "Open",
    "Opened",
    "Ping",
    "Pong",
    "Proposal",
    "ProtocolError",
    "SamplingParams",
    "Stats",
    "StatsRequest",
    "Welcome",
    "array_field",
    "compatibility_problems",
    "curve_arrays",
    "decode",
    "encode",
    "feature_taps",
    "timing_us",
]

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
    arrays: dict[str, ArraySpec]  # array fields, in frame order
    groups: tuple[tuple[str, ...], ...]  # array fields that come all or none, equal lengths
    sparse: tuple[tuple[str, Any], ...] = ()  # body fields left out at their default: (name, it)


def _union(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _layout(cls: type) -> _Layout:
    hints = typing.get_type_hints(cls)  # the annotations are strings (postponed evaluation)
    schema: dict[str, frozenset[type]] = {}
    arrays: dict[str, ArraySpec] = {}
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


def _groups(arrays: dict[str, ArraySpec]) -> tuple[tuple[str, ...], ...]:
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
