"""The hub over real sockets (loopback, random port): errors, isolation, handshake checks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from conftest import PROMPT, RunningHub

from edge.backends.torch import TorchBackend
from edge.batcher import Batcher
from edge.client import HubClient
from edge.handshake import HubError, TargetInfo
from edge.speculate import generate_speculative
from edge.verifier import TargetSequence
from starsd import models, protocol, transport
from starsd.params import TEMPERATURE_MIN
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
    SamplingParams,
    Welcome,
)


def _header(kind: int, body: object, version: int = protocol.PROTOCOL_VERSION) -> bytes:
    return bytes((version, kind)) + msgpack.packb(body, use_bin_type=True)


BAD_MESSAGES = {
    "truncated": [b"\x01"],
    "wrong type byte": [_header(99, {})],
    "wrong version": [_header(Ping.TYPE, {"nonce": 1}, version=7)],
    "garbage body": [bytes((protocol.PROTOCOL_VERSION, 8)) + b"\xff\xff\xff"],
    "wrong field type": [_header(Ping.TYPE, {"nonce": "x"})],
    "length mismatch": [
        _header(
            Draft.TYPE,
            {"tag": b"x" * 16, "seq": 1, "accepted": 0, "arrays": [["appended", "int32", [3]]]},
        ),
        b"\0" * 5,
    ],
    # (a frame over the hub's socket limit drops the connection: tests/test_hostile_wire.py)
    "too many frames": [
        _header(
            Draft.TYPE,
            {"tag": b"x" * 16, "seq": 1, "accepted": 0, "arrays": [["appended", "int32", [1]]]},
        ),
        *[b"\0" * 4] * protocol.MAX_FRAMES,
    ],
}
EXPECTED_CODE = {
    "truncated": ErrorCode.MALFORMED,
    "wrong type byte": ErrorCode.MALFORMED,
    "wrong version": ErrorCode.VERSION_MISMATCH,
    "garbage body": ErrorCode.MALFORMED,
    "wrong field type": ErrorCode.MALFORMED,
    "length mismatch": ErrorCode.MALFORMED,
    "too many frames": ErrorCode.TOO_LARGE,
}


async def test_every_bad_frame_gets_an_error_and_the_hub_keeps_serving(
    raw, running_hub: RunningHub, llama_target: models.LoadedModel
) -> None:
    bystander = raw()
    await bystander.hello(llama_target)
    tag, _ = await bystander.open()
    attacker = raw()
    for name, frames in BAD_MESSAGES.items():
        await attacker.send_frames(frames)
        reply = await attacker.recv()
        assert isinstance(reply, Error) and reply.code == EXPECTED_CODE[name], (name, reply)
        pong = await attacker.ask(Ping(7))  # the next valid request is answered
        assert isinstance(pong, Pong) and pong.nonce == 7 and pong.epoch == running_hub.hub.epoch
    await attacker.hello(llama_target)
    await attacker.open()
    # the bystander's session was not disturbed: its next round works as usual
    await bystander.send(Draft(tag, 1, 2, np.array([9], dtype=np.int32)))
    nxt = await bystander.recv()
    assert isinstance(nxt, Proposal) and nxt.seq == 1 and len(nxt.tokens) == 4


async def test_open_before_hello_is_refused(raw) -> None:
    target = raw()
    reply = await target.ask(Open(1, PROMPT, SamplingParams(), 4))
    assert isinstance(reply, Error) and reply.code == ErrorCode.NOT_WELCOMED and reply.ref is None


@pytest.mark.parametrize("field", ["vocab_size", "tokenizer"])
async def test_hello_mismatch_is_refused_naming_the_difference(
    raw, llama_target: models.LoadedModel, field: str
) -> None:
    vocab = llama_target.vocab_size + (field == "vocab_size")
    fingerprint = "0" * 16 if field == "tokenizer" else llama_target.tokenizer_fingerprint
    target = raw()
    reply = await target.ask(Hello("other", vocab, fingerprint))
    assert isinstance(reply, Error) and reply.code == ErrorCode.INCOMPATIBLE
    assert f"{field} differs" in reply.message
    refused = await target.ask(Open(1, PROMPT, SamplingParams(), 4))
    assert isinstance(refused, Error) and refused.code == ErrorCode.NOT_WELCOMED


async def test_stats_reply_carries_the_service_curve(raw, llama_target: models.LoadedModel) -> None:
    """Catches a hub whose STATS reply leaves the curve out, or whose curve disagrees with its
    own batch and job counters (the drafting thread records both under one lock)."""
    target = raw()
    await target.hello(llama_target)
    await target.open()  # the opening proposal: one batch drafted
    reply = await target.ask(protocol.StatsRequest(5))
    assert isinstance(reply, protocol.Stats) and reply.nonce == 5
    rows = reply.service_totals()
    assert rows and sum(count for _, count, _ in rows) == reply.batches
    assert sum(size * count for size, count, _ in rows) == reply.jobs
    assert sum(seconds for *_, seconds in rows) == pytest.approx(reply.busy_s, rel=1e-5)


async def test_session_errors(raw, llama_target: models.LoadedModel) -> None:
    target = raw()
    await target.hello(llama_target)
    tag, _ = await target.open()
    cases = [
        (Draft(b"\x00" * 16, 1, 0, PROMPT[:1]), ErrorCode.UNKNOWN_SESSION),
        (Draft(tag, 5, 0, PROMPT[:1]), ErrorCode.OUT_OF_ORDER),
        (Draft(tag, 1, 9, PROMPT[:1]), ErrorCode.INVALID_ARGUMENT),  # accepted > gamma
        (Draft(tag, 1, 0, np.array([10**6], dtype=np.int32)), ErrorCode.INVALID_ARGUMENT),
        (Open(2, np.zeros(0, dtype=np.int32), SamplingParams(), 4), ErrorCode.INVALID_ARGUMENT),
        (Open(3, PROMPT, SamplingParams(), 99), ErrorCode.INVALID_ARGUMENT),
        (Welcome("x", 1, "x", b"", 1, 1), ErrorCode.UNEXPECTED),
    ]
    for msg, code in cases:
        reply = await target.ask(msg)
        assert isinstance(reply, Error) and reply.code == code, (msg, reply)
    # after all of that, the real next round still works, and a duplicate of it is refused
    await target.send(Draft(tag, 1, 1, PROMPT[:1]))
    await target.send(Draft(tag, 1, 1, PROMPT[:1]))
    replies = [await target.recv(), await target.recv()]
    codes = sorted(type(r).__name__ + ":" + getattr(r, "code", "") for r in replies)
    assert codes in (["Error:BUSY", "Proposal:"], ["Error:OUT_OF_ORDER", "Proposal:"]), replies


async def test_sampling_outside_the_valid_range_is_refused_at_open(
    raw, llama_target: models.LoadedModel
) -> None:
    # temperatures of 1e-38, 1e-300, 5e-324 once opened sessions whose every draft failed on NaN
    # probabilities (INTERNAL and a traceback per job); the edge of the range drafts normally
    target = raw()
    await target.hello(llama_target)
    for temperature in (1e-38, 1e-300, 5e-324):
        reply = await target.ask(Open(7, PROMPT, SamplingParams(temperature), 4))
        assert isinstance(reply, Error) and reply.code == ErrorCode.INVALID_ARGUMENT, reply
        assert reply.message.startswith(f"temperature {temperature!r} is out of range")
        assert "[0.01, 100]" in reply.message
    lowest = TEMPERATURE_MIN
    for ref, params in enumerate(
        [SamplingParams(lowest, seed=1), SamplingParams(lowest, top_p=5e-324, seed=2)], 8
    ):
        await target.send(Open(ref, PROMPT, params, 4))
        opened, proposal = await target.recv(), await target.recv()
        assert isinstance(opened, Opened) and opened.ref == ref, opened
        assert isinstance(proposal, Proposal) and len(proposal.tokens) == 4, proposal


async def test_a_foreign_tag_is_forbidden_and_changes_nothing(
    raw, running_hub: RunningHub, llama_target: models.LoadedModel
) -> None:
    owner, intruder = raw(), raw()
    await owner.hello(llama_target)
    await intruder.hello(llama_target)
    tag, _ = await owner.open()
    own_tag, _ = await intruder.open(ref=5)
    state = running_hub.hub.sessions[tag].state
    before = (list(state.tokens), list(state.proposed))
    for msg in (Draft(tag, 1, 2, np.array([3], dtype=np.int32)), Close(tag)):
        reply = await intruder.ask(msg)
        assert isinstance(reply, Error) and reply.code == ErrorCode.FORBIDDEN
        assert reply.tag == tag  # echoes only what the intruder sent; no proposal leaks
    assert (list(state.tokens), list(state.proposed)) == before
    assert tag in running_hub.hub.sessions and own_tag in running_hub.hub.sessions
    await owner.send(Draft(tag, 1, 0, np.array([3], dtype=np.int32)))
    assert isinstance(await owner.recv(), Proposal)


def _greedy_reference(target: models.LoadedModel, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=0,
        eos_token_id=sorted(target.eos_token_ids) or None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


async def _speculate(
    endpoint: str,
    target: models.LoadedModel,
    prompts: list[list[int]],
    n: int,
    params: SamplingParams,
) -> list[TargetSequence]:
    ctx = transport.new_context()
    info = TargetInfo("t", target.vocab_size, target.tokenizer_fingerprint)
    client = HubClient(ctx, endpoint, info)
    await client.connect()
    backend = TorchBackend(target)
    batcher = Batcher(backend)
    seqs = [TargetSequence(backend, p, params, n) for p in prompts]
    try:
        await asyncio.gather(*(generate_speculative(client, s, 4, batcher) for s in seqs))
    finally:
        await client.aclose()
        await batcher.aclose()
        ctx.term()
    return seqs


async def test_speculative_greedy_equals_generate_in_process(
    running_hub: RunningHub, llama_target: models.LoadedModel
) -> None:
    prompts = [[5, 17, 33, 8], [1], list(range(40, 60))]
    seqs = await _speculate(running_hub.endpoint, llama_target, prompts, 40, SamplingParams())
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.generated == _greedy_reference(llama_target, prompt, 40)
    assert sum(s.stats.accepted for s in seqs) > 0  # the draft agrees sometimes...
    assert sum(s.stats.proposed - s.stats.accepted for s in seqs) > 0  # ...and not always


async def test_eos_stops_exactly_where_the_target_alone_stops(
    running_hub: RunningHub, llama_pair: tuple[Path, Path]
) -> None:
    target = models.load_causal_lm(llama_pair[0])
    prompt = [5, 17, 33, 8]
    free_run = _greedy_reference(target, prompt, 30)
    eos = free_run[12]  # a token greedy decoding emits mid-sequence becomes the EOS
    target = models.LoadedModel(**{**target.__dict__, "eos_token_ids": frozenset({eos})})
    expected = _greedy_reference(target, prompt, 30)
    assert expected[-1] == eos and len(expected) <= 13
    (seq,) = await _speculate(running_hub.endpoint, target, [prompt], 30, SamplingParams())
    assert seq.generated == expected


async def test_hub_refusal_reaches_the_client_as_hub_error(
    running_hub: RunningHub, llama_target: models.LoadedModel
) -> None:
    ctx = transport.new_context()
    info = TargetInfo("t", llama_target.vocab_size + 1, llama_target.tokenizer_fingerprint)
    client = HubClient(ctx, running_hub.endpoint, info)
    with pytest.raises(HubError, match="vocab_size differs"):
        await client.connect()
    await client.aclose()
    ctx.term()
