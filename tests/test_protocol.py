"""Wire protocol: round trips and hardened decoding (pure, no sockets)."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import MISSING

import msgpack
import numpy as np
import pytest

from starsd import limits, params, protocol
from starsd.protocol import (
    Close,
    Draft,
    Error,
    ErrorCode,
    Hello,
    Open,
    Opened,
    Ping,
    Pong,
    Proposal,
    ProtocolError,
    SamplingParams,
    Welcome,
    decode,
    encode,
)

TAG = bytes(range(16))


def _frames(msg: protocol.Message) -> list[bytes]:
    return [bytes(f) for f in encode(msg)]


def _equal(a: protocol.Message, b: protocol.Message) -> bool:
    if type(a) is not type(b):
        return False
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)):
                return False
            if x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return True


MESSAGES: list[protocol.Message] = [
    Hello("target-7b", 32000, "abc123"),
    Welcome("draft", 32000, "abc123", b"\x01" * 8, 4, 16),
    Open(3, np.arange(5, dtype=np.int32), SamplingParams(0.7, 50, 0.9, 42), 4),
    Open(4, np.arange(1, dtype=np.int64), SamplingParams(), 0),
    Opened(3, TAG),
    Draft(TAG, 2, 3, np.array([17], dtype=np.int32)),
    Draft(TAG, 5, 0, np.zeros(0, dtype=np.int32)),
    Proposal(TAG, 0, np.array([1, 2, 3, 4], dtype=np.int32)),
    Proposal(TAG, 1, np.array([1, 2], dtype=np.int32), np.full((2, 10), 0.1, dtype=np.float32)),
    Proposal(
        TAG,
        2,
        np.array([1, 2], dtype=np.int32),
        np.array([[0.6, 0.4], [1.0, 0.0]], dtype=np.float32),
        np.array([[1, 7], [2, 0]], dtype=np.int32),
    ),
    Proposal(TAG, 3, np.zeros(0, dtype=np.int32), alone=16),  # gamma 0: decode 16 alone
    Close(TAG),
    Ping(7),
    Pong(7),
    Error(ErrorCode.FORBIDDEN, "not yours", tag=TAG, seq=3),
    Error(ErrorCode.MALFORMED, "bad"),
    protocol.StatsRequest(3),
    # with the service curve first: the schema tests below edit the first sample of each type,
    # and a curve array alone, without the rest of its group, is malformed
    protocol.Stats(
        3,
        1.5,
        0.5,
        10,
        4,
        2,
        1,
        9,
        36,
        20,
        0.01,
        b"\x02" * 8,
        np.array([1, 8], np.int32),
        np.array([3, 1 << 40], np.int64),
        np.array([0.0125, 0.0047], np.float32),
    ),
    protocol.Stats(3, 1.5, 0.5, 10, 4, 2, 1, 9, 36, 20, 0.01),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: protocol.Message) -> None:
    assert _equal(decode(_frames(msg)), msg)


def test_arrays_travel_as_raw_frames_zero_copy() -> None:
    q = np.random.default_rng(0).random((4, 1000), dtype=np.float32)
    frames = _frames(Proposal(TAG, 0, np.arange(4, dtype=np.int32), q))
    assert len(frames) == 3 and len(frames[2]) == q.nbytes
    buffers = [memoryview(bytearray(f)) for f in frames]
    out = decode(buffers)
    assert isinstance(out, Proposal) and out.q_probs is not None
    assert np.shares_memory(out.q_probs, np.asarray(buffers[2]))  # a view, not a copy
    assert not out.q_probs.flags.writeable


def _header(version: int, kind: int, body: object) -> bytes:
    return bytes((version, kind)) + msgpack.packb(body, use_bin_type=True)


V = protocol.PROTOCOL_VERSION
GOOD_DRAFT = _frames(Draft(TAG, 1, 0, np.array([5], dtype=np.int32)))

_STATS_BODY = {
    "nonce": 1,
    "wall_s": 1.0,
    "busy_s": 0.5,
    "jobs": 2,
    "batches": 1,
    "sessions": 1,
    "targets": 1,
    "rounds": 2,
    "proposed": 8,
    "accepted": 4,
    "queue_wait_s": 0.0,
}

BAD_FRAMES = {
    "empty": ([], ErrorCode.MALFORMED),
    "truncated header": ([b"\x01"], ErrorCode.MALFORMED),
    "wrong version": ([_header(9, Ping.TYPE, {"nonce": 1})], ErrorCode.VERSION_MISMATCH),
    "unknown type": ([_header(V, 200, {})], ErrorCode.MALFORMED),
    "not msgpack": ([bytes((V, 8)) + b"\xc1\xc1\xc1"], ErrorCode.MALFORMED),
    "truncated msgpack": ([GOOD_DRAFT[0][:-3], GOOD_DRAFT[1]], ErrorCode.MALFORMED),
    "body not a map": ([_header(V, Ping.TYPE, [1, 2])], ErrorCode.MALFORMED),
    "missing field": ([_header(V, Ping.TYPE, {})], ErrorCode.MALFORMED),
    "unknown field": ([_header(V, Ping.TYPE, {"nonce": 1, "x": 2})], ErrorCode.MALFORMED),
    "wrong type": ([_header(V, Ping.TYPE, {"nonce": "1"})], ErrorCode.MALFORMED),
    "bool as int": ([_header(V, Ping.TYPE, {"nonce": True})], ErrorCode.MALFORMED),
    # msgpack carries uint64; past int64 a seed or a count overflows numpy on the other side
    "int out of range": ([_header(V, Ping.TYPE, {"nonce": 1 << 63})], ErrorCode.MALFORMED),
    "array frame missing": ([GOOD_DRAFT[0]], ErrorCode.MALFORMED),
    "extra frame": ([*GOOD_DRAFT, b"1234"], ErrorCode.MALFORMED),
    "length != shape": ([GOOD_DRAFT[0], b"\x00" * 5], ErrorCode.MALFORMED),
    "too many frames": ([GOOD_DRAFT[0]] + [b""] * 20, ErrorCode.TOO_LARGE),
    "oversized header": (
        [_header(V, Ping.TYPE, {"nonce": 1}) + b"\x00" * 70_000],
        ErrorCode.TOO_LARGE,
    ),
    "oversized array": (
        [
            _header(
                V,
                Draft.TYPE,
                {
                    "tag": TAG,
                    "seq": 1,
                    "accepted": 0,
                    "arrays": [["appended", "int32", [5_000_000]]],
                },
            ),
            b"\x00" * 20_000_000,
        ],
        ErrorCode.TOO_LARGE,
    ),
    "bad dtype": (
        [
            _header(
                V,
                Draft.TYPE,
                {"tag": TAG, "seq": 1, "accepted": 0, "arrays": [["appended", "object", [1]]]},
            ),
            b"\x00" * 8,
        ],
        ErrorCode.MALFORMED,
    ),
    "dtype not a string": (
        [  # unhashable: once escaped as TypeError, i.e. an INTERNAL reply
            _header(
                V,
                Draft.TYPE,
                {"tag": TAG, "seq": 1, "accepted": 0, "arrays": [["appended", [1], [1]]]},
            ),
            b"\x00" * 4,
        ],
        ErrorCode.MALFORMED,
    ),
    "float tokens": (
        [
            _header(
                V,
                Draft.TYPE,
                {"tag": TAG, "seq": 1, "accepted": 0, "arrays": [["appended", "float32", [1]]]},
            ),
            b"\x00" * 4,
        ],
        ErrorCode.MALFORMED,
    ),
    "bad shape": (
        [
            _header(
                V,
                Draft.TYPE,
                {"tag": TAG, "seq": 1, "accepted": 0, "arrays": [["appended", "int32", [-1]]]},
            ),
            b"",
        ],
        ErrorCode.MALFORMED,
    ),
    "wrong rank": (
        [
            _header(
                V,
                Draft.TYPE,
                {"tag": TAG, "seq": 1, "accepted": 0, "arrays": [["appended", "int32", [1, 1]]]},
            ),
            b"\x00" * 4,
        ],
        ErrorCode.MALFORMED,
    ),
    "huge container": (
        [_header(V, Ping.TYPE, {"nonce": 1})[:2] + msgpack.packb({"nonce": list(range(1000))})],
        ErrorCode.MALFORMED,
    ),
    "ext type": (
        [bytes((V, 8)) + msgpack.packb({"nonce": msgpack.ExtType(1, b"x")})],
        ErrorCode.MALFORMED,
    ),
    # unknown keys of both str and bytes type: sorting them for the message once raised
    # TypeError (an INTERNAL reply with a traceback) instead of MALFORMED
    "unknown keys str and bytes": (
        [_header(V, Ping.TYPE, {"nonce": 1, "zz": 1, b"yy": 2})],
        ErrorCode.MALFORMED,
    ),
    "unknown sampling keys str and bytes": (
        [
            _header(
                V,
                Open.TYPE,
                {
                    "ref": 1,
                    "gamma": 4,
                    "sampling": {"zz": 1, b"yy": 2},
                    "arrays": [["prompt", "int32", [1]]],
                },
            ),
            b"\x00" * 4,
        ],
        ErrorCode.MALFORMED,
    ),
    "bad sampling": (
        [
            _header(
                V,
                Open.TYPE,
                {
                    "ref": 1,
                    "gamma": 4,
                    "sampling": {"temperature": -1.0},
                    "arrays": [["prompt", "int32", [1]]],
                },
            ),
            b"\x00" * 4,
        ],
        ErrorCode.INVALID_ARGUMENT,
    ),
    "nan temperature": (
        [
            _header(
                V,
                Open.TYPE,
                {
                    "ref": 1,
                    "gamma": 4,
                    "sampling": {"temperature": float("nan")},
                    "arrays": [["prompt", "int32", [1]]],
                },
            ),
            b"\x00" * 4,
        ],
        ErrorCode.INVALID_ARGUMENT,
    ),
    # a temperature of 1e-38 once decoded fine and the drafter then failed on NaN probabilities
    # the service curve's columns must line up: a row with no count cannot be read
    "curve lengths differ": (
        [
            _header(
                V,
                protocol.Stats.TYPE,
                {
                    **_STATS_BODY,
                    "arrays": [
                        ["batch_sizes", "int32", [2]],
                        ["batch_counts", "int64", [1]],
                        ["batch_busy_s", "float32", [2]],
                    ],
                },
            ),
            b"\x00" * 8,
            b"\x00" * 8,
            b"\x00" * 8,
        ],
        ErrorCode.MALFORMED,
    ),
    "curve without counts": (
        [
            _header(
                V,
                protocol.Stats.TYPE,
                {
                    **_STATS_BODY,
                    "arrays": [["batch_sizes", "int32", [1]], ["batch_busy_s", "float32", [1]]],
                },
            ),
            b"\x00" * 4,
            b"\x00" * 4,
        ],
        ErrorCode.MALFORMED,
    ),
    "tiny temperature": (
        [
            _header(
                V,
                Open.TYPE,
                {
                    "ref": 1,
                    "gamma": 4,
                    "sampling": {"temperature": 1e-38},
                    "arrays": [["prompt", "int32", [1]]],
                },
            ),
            b"\x00" * 4,
        ],
        ErrorCode.INVALID_ARGUMENT,
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_FRAMES))
def test_malformed_frames_raise_protocol_error(name: str) -> None:
    frames, code = BAD_FRAMES[name]
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert info.value.code == code, info.value


def test_sampling_params_semantics() -> None:
    assert SamplingParams().greedy and not SamplingParams().truncated
    assert SamplingParams(1.0, top_k=5).truncated
    assert SamplingParams(1.0, top_p=0.9).truncated
    assert not SamplingParams(1.0).truncated
    with pytest.raises(ProtocolError):
        SamplingParams(1.0, top_p=0.0).validate()


# The valid ranges (SamplingParams' docstring), at and just outside each boundary. Temperatures
# such as 1e-38, 1e-300 and 5e-324 once passed validate(): logits / temperature overflowed float32
# (or divided by a float32 zero) and every draft failed on NaN probabilities (INTERNAL).
_T_MIN, _T_MAX = params.TEMPERATURE_MIN, params.TEMPERATURE_MAX
ACCEPTED_SAMPLING = [
    SamplingParams(0.0),
    SamplingParams(-0.0),
    SamplingParams(_T_MIN),
    SamplingParams(_T_MAX),
    SamplingParams(1.0, top_k=0),
    SamplingParams(1.0, top_k=params.TOP_K_MAX),
    SamplingParams(1.0, top_p=5e-324),
    SamplingParams(1.0, top_p=1.0),
    SamplingParams(1.0, seed=None),
    SamplingParams(1.0, seed=0),
    SamplingParams(1.0, seed=(1 << 63) - 1),
]
REFUSED_SAMPLING = {
    "temperature": [
        1e-38,
        1e-300,
        5e-324,
        -5e-324,
        math.nextafter(_T_MIN, 0.0),
        math.nextafter(_T_MAX, math.inf),
        -1.0,
        math.nan,
        math.inf,
        -math.inf,
    ],
    "top_k": [-1, params.TOP_K_MAX + 1, 1 << 64, 2.0, True],
    "top_p": [0.0, -0.0, -5e-324, math.nextafter(1.0, 2.0), math.nan, math.inf, -math.inf],
    "seed": [-1, 1 << 63, 1.0],
}
VALID_RANGE = {
    "temperature": "0 (greedy) or in [0.01, 100]",
    "top_k": "[0, 1048576]",
    "top_p": "(0, 1]",
    "seed": "[0, 2**63)",
}


@pytest.mark.parametrize("params", ACCEPTED_SAMPLING, ids=repr)
def test_sampling_boundaries_are_accepted(params: SamplingParams) -> None:
    params.validate()


@pytest.mark.parametrize(
    ("field", "value"),
    [(field, value) for field, values in REFUSED_SAMPLING.items() for value in values],
    ids=repr,
)
def test_sampling_just_outside_the_range_is_refused_naming_field_and_range(
    field: str, value: object
) -> None:
    base = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": None}
    with pytest.raises(ProtocolError) as info:
        SamplingParams(**{**base, field: value}).validate()
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    assert info.value.message.startswith(f"{field} "), info.value.message
    assert VALID_RANGE[field] in info.value.message, info.value.message


def test_features_and_empty_arrays_round_trip() -> None:
    features = np.arange(12, dtype=np.float16).reshape(3, 4)
    msg = Draft(TAG, 2, 2, np.array([5], dtype=np.int32), features)
    out = decode(_frames(msg))
    assert isinstance(out, Draft) and out.features is not None
    assert out.features.dtype == np.float16 and np.array_equal(out.features, features)
    empty = decode(
        _frames(Open(1, np.array([5], np.int32), SamplingParams(), 4, np.zeros((0, 4), np.float16)))
    )
    assert isinstance(empty, Open) and empty.features is not None
    assert empty.features.shape == (0, 4)


# ------------------------------------------------- the schema is the dataclasses, nothing else

# the first sample of each message type
SAMPLES: dict[type, protocol.Message] = {type(m): m for m in reversed(MESSAGES)}
# What each annotation admits on the wire, written out here rather than read from the decoder,
# so that the decoder's derivation is checked against the dataclasses it claims to follow.
WIRE: dict[object, set[type]] = {
    int: {int},
    float: {float, int},
    str: {str},
    bytes: {bytes},
    type(None): {type(None)},
    SamplingParams: {dict},
}
CANDIDATES = [1, 0.5, "s", b"b", None, True, [1], {}]  # one value of each msgpack kind


def _parts(msg: protocol.Message) -> tuple[dict, list[tuple[list, bytes]]]:
    """A sample's body and its (array descriptor, frame) pairs, to edit and re-send."""
    frames = _frames(msg)
    body = msgpack.unpackb(frames[0][2:])
    return body, list(zip(body.pop("arrays", []), frames[1:], strict=True))


def _send(cls: type, body: dict, arrays: list[tuple[list, bytes]]) -> list[bytes]:
    body = {**body, "arrays": [desc for desc, _ in arrays]} if arrays else body
    return [_header(V, cls.TYPE, body), *(frame for _, frame in arrays)]  # type: ignore[attr-defined]


def _with_field(cls: type, name: str, value: object) -> list[bytes]:
    """A valid message with body field ``name`` (of ``cls``, or of Open's sampling) set."""
    base = Open if cls is SamplingParams else cls
    body, arrays = _parts(SAMPLES[base])
    (body["sampling"] if cls is SamplingParams else body)[name] = value
    return _send(base, body, arrays)


def _read(msg: protocol.Message, cls: type, name: str) -> object:
    """Field ``name`` of a decoded message, or of its sampling when ``cls`` is SamplingParams."""
    return getattr(msg.sampling if isinstance(msg, Open) and cls is SamplingParams else msg, name)


def _body_fields(cls: type) -> list[tuple[str, set[type]]]:
    hints = typing.get_type_hints(cls)
    cases = []
    for f in dataclasses.fields(cls):
        if "array" not in f.metadata:
            wire: set[type] = set()
            for part in typing.get_args(hints[f.name]) or (hints[f.name],):  # X | None: both
                wire |= WIRE[part]
            cases.append((f.name, wire))
    return cases


SCHEMA_CLASSES = [*protocol.MESSAGE_TYPES.values(), SamplingParams]
FIELD_CASES = [(cls, name, wire) for cls in SCHEMA_CLASSES for name, wire in _body_fields(cls)]


@pytest.mark.parametrize(
    ("cls", "name", "wire"), FIELD_CASES, ids=[f"{c.__name__}.{n}" for c, n, _ in FIELD_CASES]
)
def test_field_types_come_from_annotations(cls: type, name: str, wire: set[type]) -> None:
    for value in CANDIDATES:
        frames = _with_field(cls, name, value)
        if type(value) not in wire:
            with pytest.raises(ProtocolError) as info:
                decode(frames)
            assert info.value.code == ErrorCode.MALFORMED, (value, info.value)
            continue
        out = decode(frames)
        got = _read(out, cls, name)
        assert isinstance(value, dict) or got == value, (value, got)


ARRAY_CASES = [
    (cls, f.name, f.metadata["array"])
    for cls in protocol.MESSAGE_TYPES.values()
    for f in dataclasses.fields(cls)
    if "array" in f.metadata
]


@pytest.mark.parametrize(
    ("cls", "name", "spec"), ARRAY_CASES, ids=[f"{c.__name__}.{n}" for c, n, _ in ARRAY_CASES]
)
def test_array_dtypes_and_rank_come_from_field_metadata(cls: type, name: str, spec: object) -> None:
    dtypes, rank = spec.dtypes, spec.rank  # type: ignore[attr-defined]
    body, arrays = _parts(SAMPLES[cls])
    others = [(desc, frame) for desc, frame in arrays if desc[0] != name]
    for dtype in sorted(protocol.ALLOWED_DTYPES):
        for shape in ([2] * (rank - 1), [2] * rank, [2] * (rank + 1)):
            frame = bytes(np.dtype(dtype).itemsize * math.prod(shape))
            frames = _send(cls, body, [*others, ([name, dtype, shape], frame)])
            if dtype in dtypes and len(shape) == rank:
                arr = getattr(decode(frames), name)
                assert arr.dtype == dtype and list(arr.shape) == shape
                continue
            with pytest.raises(ProtocolError) as info:
                decode(frames)
            assert info.value.code == ErrorCode.MALFORMED, (dtype, shape, info.value)


def _left_out_with(cls: type, name: str) -> set[str]:
    """``name`` and the arrays of its group (a group is optional as a whole, never in part)."""
    group = {
        f.name: f.metadata["array"].group for f in dataclasses.fields(cls) if "array" in f.metadata
    }
    return {n for n, g in group.items() if g and g == group.get(name)} | {name}


@pytest.mark.parametrize("cls", SCHEMA_CLASSES, ids=lambda c: c.__name__)
def test_required_fields_are_those_without_defaults(cls: type) -> None:
    base = Open if cls is SamplingParams else cls
    for f in dataclasses.fields(cls):
        body, arrays = _parts(SAMPLES[base])
        (body["sampling"] if cls is SamplingParams else body).pop(f.name, None)
        left_out = _left_out_with(cls, f.name)
        frames = _send(base, body, [(d, frame) for d, frame in arrays if d[0] not in left_out])
        if f.default is MISSING and f.default_factory is MISSING:
            with pytest.raises(ProtocolError) as info:
                decode(frames)
            assert info.value.code == ErrorCode.MALFORMED, (f.name, info.value)
        else:
            out = decode(frames)
            assert _read(out, cls, f.name) == f.default, f.name


def test_a_field_with_no_wire_form_is_refused_at_import() -> None:
    @dataclasses.dataclass
    class Listed:
        ids: list[int]

    @dataclasses.dataclass
    class Unmarked:
        ids: np.ndarray  # an array with no dtypes or rank declared

    @dataclasses.dataclass
    class Mismarked:
        n: int = dataclasses.field(
            default=0, metadata=protocol.array_field(frozenset({"int32"}), 1)
        )

    for cls in (Listed, Unmarked, Mismarked):
        with pytest.raises(TypeError):
            protocol._layout(cls)
    with pytest.raises(ValueError):
        protocol.array_field(frozenset({"float64"}), 1)  # decode could not build it


def test_stats_carries_the_service_curve() -> None:
    """Catches curve columns that lose their dtype or values on the way (a float64 sum where the
    wire has no float64, counts cut to int32), or a Stats that old callers can no longer build."""
    msg = next(m for m in MESSAGES if isinstance(m, protocol.Stats) and m.batch_sizes is not None)
    out = decode(_frames(msg))
    assert isinstance(out, protocol.Stats) and out.batch_busy_s is not None
    assert out.batch_sizes.tolist() == [1, 8] and out.batch_counts.tolist() == [3, 1 << 40]
    assert out.batch_busy_s.dtype == np.float32
    assert out.batch_busy_s.tolist() == pytest.approx([0.0125, 0.0047], rel=1e-7)
    old = decode(_frames(protocol.Stats(3, 1.5, 0.5, 10, 4, 2, 1, 9, 36, 20, 0.01)))
    assert isinstance(old, protocol.Stats) and old.batch_sizes is None  # no curve: still fine


def test_a_group_needs_a_first_dimension() -> None:
    with pytest.raises(ValueError):
        protocol.array_field(frozenset({"int32"}), 0, "curve")


def test_hub_stats_curve_round_trips_through_stats() -> None:
    """Catches a hub that sends means where the reader expects totals, or that mixes up the
    columns (sizes and counts are both integers: only the values can tell)."""
    from starsd.stats import HubStats

    hub = HubStats()
    for jobs, seconds in [(8, 0.005), (1, 0.004), (8, 0.007)]:
        hub.record_batch(jobs, seconds, seconds)
    msg = protocol.Stats(
        1,
        1.0,
        hub.busy_s,
        hub.jobs,
        hub.batches,
        1,
        1,
        3,
        12,
        6,
        0.0,
        **protocol.curve_arrays(hub.service_totals()),
    )
    out = decode(_frames(msg))
    assert isinstance(out, protocol.Stats)
    assert out.service_totals() == [(1, 1, pytest.approx(0.004)), (8, 2, pytest.approx(0.012))]
    assert protocol.Stats(1, 1.0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0.0).service_totals() == []
    empty = decode(
        _frames(protocol.Stats(1, 1.0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0.0, **protocol.curve_arrays([])))
    )
    assert isinstance(empty, protocol.Stats) and empty.service_totals() == []


def test_proposal_alone_travels_only_when_used() -> None:
    """Catches ``alone`` sent at 0: a target from before the field refuses unknown keys, so it
    would refuse every proposal of a newer hub instead of only the spans alone it cannot do."""
    plain = msgpack.unpackb(_frames(Proposal(TAG, 0, np.array([1], np.int32)))[0][2:])
    assert "alone" not in plain
    span = msgpack.unpackb(_frames(Proposal(TAG, 0, np.zeros(0, np.int32), alone=8))[0][2:])
    assert span["alone"] == 8
    out = decode(_frames(Proposal(TAG, 0, np.zeros(0, np.int32), alone=8)))
    assert isinstance(out, Proposal) and out.alone == 8


def test_a_drafts_times_are_clamped_to_what_a_hub_accepts() -> None:
    """Catches a target sending a time the hub refuses (INVALID_ARGUMENT would drop an honest
    target's DRAFT): a clock read backwards gives 0, a stall past the limit gives the limit,
    and the rest round to whole microseconds."""
    assert protocol.timing_us(-0.001) == 0
    assert protocol.timing_us(1e9) == limits.MAX_TIMING_US
    assert protocol.timing_us(0.1234567) == 123457
