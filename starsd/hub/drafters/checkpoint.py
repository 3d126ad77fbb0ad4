"""Reading a head's checkpoint and the parts of its target it drafts with.

An EAGLE hub never loads the whole target: it reads the token embedding and the LM head tensor
by tensor (``safetensors.safe_open``). A head's own weights come from ``model.safetensors`` or a
``pytorch_model.bin`` read with ``torch.load(weights_only=True)`` (never unpickled otherwise).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from starsd.models import DTYPES  # one dtype table for every model we load

EMBED_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"
SAFETENSORS_NAME = "model.safetensors"
PYTORCH_NAME = "pytorch_model.bin"
CONFIG_NAME = "config.json"


@dataclass(frozen=True)
class TargetHeadWeights:
    """The only parts of the target the hub needs: token embedding, LM head and config."""

    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H] (the same tensor as ``embed`` when tied)
    config: dict[str, Any]
    tied: bool

    @property
    def hidden_size(self) -> int:
        """Width of the target's features."""
        return int(self.embed.shape[1])

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head (width of the logits)."""
        return int(self.lm_head.shape[0])


def _weight_files(target_dir: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file of a (possibly sharded) checkpoint directory."""
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: target_dir / file for name, file in weight_map.items()}
    single = target_dir / SAFETENSORS_NAME
    if not single.exists():
        raise ValueError(f"{target_dir}: no model.safetensors or model.safetensors.index.json")
    with safe_open(str(single), framework="pt") as handle:
        return {name: single for name in handle.keys()}  # noqa: SIM118 (safe_open is no dict)


def _read_tensor(files: Mapping[str, Path], name: str) -> torch.Tensor:
    with safe_open(str(files[name]), framework="pt") as handle:
        return handle.get_tensor(name)


def read_target_head(
    target_dir: str | Path, dtype: str = "float32", device: str = "cpu"
) -> TargetHeadWeights:
    """Read the target's token embedding and LM head (tied when the config or file says so).

    Only ``model.embed_tokens.weight`` and ``lm_head.weight`` are read, with ``safe_open``;
    the rest of the checkpoint is never loaded.

    Raises:
        ValueError: for an unknown dtype or a checkpoint without an embedding.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    root = Path(target_dir)
    config = json.loads((root / CONFIG_NAME).read_text())
    files = _weight_files(root)
    if EMBED_KEY not in files:
        raise ValueError(f"{root}: checkpoint has no {EMBED_KEY}")
    embed = _read_tensor(files, EMBED_KEY).to(device=device, dtype=DTYPES[dtype])
    tied = bool(config.get("tie_word_embeddings", False)) or LM_HEAD_KEY not in files
    lm_head = embed if tied else _read_tensor(files, LM_HEAD_KEY).to(device, DTYPES[dtype])
    return TargetHeadWeights(embed=embed, lm_head=lm_head, config=config, tied=tied)


def head_state(head_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a head's checkpoint (safetensors first, else the weights-only .bin)."""
    safetensors_path = head_dir / SAFETENSORS_NAME
    if safetensors_path.exists():
        with safe_open(str(safetensors_path), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    bin_path = head_dir / PYTORCH_NAME
    if bin_path.exists():
        state = torch.load(bin_path, map_location="cpu", weights_only=True)
        return dict(state)
    raise ValueError(f"{head_dir}: no {SAFETENSORS_NAME} or {PYTORCH_NAME}")


def rope_theta_of(data: Mapping[str, Any]) -> float:
    """A head config's rotary base: at the top level (transformers 4.x) or under
    ``rope_parameters`` / ``rope_scaling`` (5.x); ValueError for any but the default rotary."""
    for key in ("rope_parameters", "rope_scaling"):
        params = data.get(key)
        if not isinstance(params, Mapping):
            continue
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in (None, "default"):
            raise ValueError(f"unsupported rotary scaling {kind!r} in {key}")
        if "rope_theta" in params:
            return float(params["rope_theta"])
    return float(data.get("rope_theta", 10000.0))
