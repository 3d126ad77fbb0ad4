"""Shared fixtures: tiny model pairs saved to disk, an in-process hub on a random port."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import procs
import zmq.asyncio
from tiny_models import build_pair

from starsd import hub as hub_module
from starsd import models, protocol, transport
from starsd.protocol import Hello, Open, Opened, Proposal, SamplingParams, Welcome

torch.set_num_threads(1)

PROMPT = np.array([5, 17, 33, 8], dtype=np.int32)


@pytest.fixture(autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield
    procs.kill_leftovers()


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def llama_pair(model_root: Path) -> tuple[Path, Path]:
    return build_pair(model_root, "llama")


@pytest.fixture(scope="session")
def gpt2_pair(model_root: Path) -> tuple[Path, Path]:
    return build_pair(model_root, "gpt2")


@pytest.fixture(scope="session")
def target_dir(llama_pair: tuple[Path, Path]) -> Path:
    """The tiny Llama target's directory (the EAGLE heads' tests build heads for it)."""
    return llama_pair[0]


@pytest.fixture(scope="session")
def llama_target(llama_pair: tuple[Path, Path]) -> models.LoadedModel:
    return models.load_causal_lm(llama_pair[0])


class RunningHub:
    """An in-process hub serving on a random loopback port."""

    def __init__(self, hub: hub_module.Hub, task: asyncio.Task[None]) -> None:
        self.hub = hub
        self.task = task
        self.endpoint = hub.endpoint


@contextlib.asynccontextmanager
async def serving_hub(config: hub_module.HubConfig) -> AsyncIterator[RunningHub]:
    """A hub built from ``config`` serving in process until the block ends."""
    hub = hub_module.build_hub(config)
    ctx = transport.new_context()
    task = asyncio.create_task(hub.serve(ctx))
    while not hub.endpoint:
        await asyncio.sleep(0.01)
    try:
        yield RunningHub(hub, task)
    finally:
        hub.stop()
        await asyncio.wait_for(task, 10)
        ctx.term()


@pytest.fixture
async def running_hub(llama_pair: tuple[Path, Path]) -> AsyncIterator[RunningHub]:
    config = hub_module.HubConfig(
        model=str(llama_pair[1]), bind="tcp://127.0.0.1:*", stats_interval=3600
    )
    async with serving_hub(config) as running:
        yield running


class RawTarget:
    """A bare DEALER that sends whatever frames a test wants."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock, _ = transport.dealer(self.ctx, endpoint)

    async def send_frames(self, frames: list[bytes]) -> None:
        await self.sock.send_multipart(frames)

    async def send(self, msg: protocol.Message) -> None:
        await transport.send(self.sock, msg)

    async def recv(self, timeout: float = 10.0) -> protocol.Message:
        return await asyncio.wait_for(transport.recv(self.sock), timeout)

    async def ask(self, msg: protocol.Message) -> protocol.Message:
        await self.send(msg)
        return await self.recv()

    async def hello(self, target: models.LoadedModel) -> Welcome:
        reply = await self.ask(Hello("t", target.vocab_size, target.tokenizer_fingerprint))
        assert isinstance(reply, Welcome), reply
        return reply

    async def open(self, prompt: np.ndarray = PROMPT, ref: int = 1) -> tuple[bytes, Proposal]:
        await self.send(Open(ref, prompt, SamplingParams(), 4))
        opened, proposal = await self.recv(), await self.recv()
        assert isinstance(opened, Opened) and isinstance(proposal, Proposal), (opened, proposal)
        return opened.tag, proposal

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
async def raw(running_hub: RunningHub):
    targets: list[RawTarget] = []

    def make() -> RawTarget:
        targets.append(RawTarget(running_hub.endpoint))
        return targets[-1]

    yield make
    for t in targets:
        t.close()
