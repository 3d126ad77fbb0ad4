"""Shared fixtures: tiny model pairs saved to disk, an in-process hub on a random port."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build_pair

from starsd import hub as hub_module
from starsd import models, transport

torch.set_num_threads(1)


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
def llama_target(llama_pair: tuple[Path, Path]) -> models.LoadedModel:
    return models.load_causal_lm(llama_pair[0])


class RunningHub:
    """An in-process hub serving on a random loopback port."""

    def __init__(self, hub: hub_module.Hub, task: asyncio.Task[None]) -> None:
        self.hub = hub
        self.task = task
        self.endpoint = hub.endpoint


@pytest.fixture
async def running_hub(llama_pair: tuple[Path, Path]) -> AsyncIterator[RunningHub]:
    config = hub_module.HubConfig(model=str(llama_pair[1]), bind="tcp://127.0.0.1:*",
                                  stats_interval=3600)  # fmt: skip
    hub = hub_module.build_hub(config)
    ctx = transport.new_context()
    task = asyncio.create_task(hub.serve(ctx))
    while not hub.endpoint:
        await asyncio.sleep(0.01)
    yield RunningHub(hub, task)
    hub.stop()
    await asyncio.wait_for(task, 10)
    ctx.term()
