"""An EAGLE head's int8 projections (``--quantize``): what is swapped, what stays float, where
int8 is refused, and that the int8 head still predicts what the float one does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_eagle3 import head_state, write_head
from torch import nn

from starsd import hub as hub_module
from starsd import models
from starsd.hub.build import load_proposer
from starsd.hub.drafters.eagle3_head import LoadedEagle3

INT8_LINEAR = torch.ao.nn.quantized.dynamic.Linear
REAL_TARGET = models.PAIRS["smollm2"][0]  # made by `make install`; its head is committed


@pytest.fixture(scope="module")
def head_dir(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_head(tmp_path_factory.mktemp("head"), target_dir, head_state(target_dir))


def loaded(head_dir: Path, target_dir: Path, quantize: str) -> LoadedEagle3:
    config = hub_module.HubConfig(
        model=str(head_dir), draft_kind="eagle3", target=str(target_dir), quantize=quantize
    )
    proposer, _ = load_proposer(config)
    return proposer.head  # type: ignore[attr-defined, no-any-return]


def test_auto_on_a_cpu_swaps_every_projection_but_fc(head_dir: Path, target_dir: Path) -> None:
    """Catches auto leaving the head in float32 (the hub's drafting job then costs ~35% more
    here) and an fc quantized with the rest (its raw hidden states' outliers cost the real
    head 9% of its accepted drafts)."""
    head = loaded(head_dir, target_dir, "auto").head
    swapped = {n for n, m in head.named_modules() if isinstance(m, INT8_LINEAR)}
    assert swapped == {
        *(f"layers.0.self_attn.{p}_proj" for p in "qkvo"),
        *(f"layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")),
        "lm_head",
    }
    assert type(head.fc) is nn.Linear and head.fc.weight.dtype == torch.float32


def test_none_keeps_the_head_as_loaded(head_dir: Path, target_dir: Path) -> None:
    """Catches ``--quantize none`` quantizing anyway (a user comparing the two sees no change)."""
    head = loaded(head_dir, target_dir, "none").head
    assert not [m for m in head.modules() if isinstance(m, INT8_LINEAR)]


@pytest.mark.skipif(
    not (REAL_TARGET / "config.json").is_file(), reason=f"{REAL_TARGET}: run `make install` first"
)
def test_the_int8_head_predicts_what_the_float_head_does() -> None:
    """Catches a quantization that changes the head's predictions instead of rounding them.
    On the real target's own features the committed SmolLM2 head's int8 logits stay within 15%
    of its float logits (6% measured) and its top token agrees on 80% of positions or more (95%
    measured); with its fc quantized too, the fusion of the target's raw hidden states, they
    were 72% off and agreed on 10%."""
    heads = [
        loaded(REAL_TARGET.parent / "smollm2-eagle3", REAL_TARGET, q) for q in ("none", "int8")
    ]
    target = models.load_causal_lm(REAL_TARGET)
    chat = [{"role": "user", "content": "Explain how volcanoes form and why they erupt."}]
    ids = models.chat_prompt_ids(target, chat)
    _, features = models.forward_with_features(target, ids, None, heads[0].feature_layers)
    logits = []
    for head in heads:
        with torch.inference_mode():  # pairs (f_j, x_{j+1}), as the hub feeds them
            out = head.head(torch.tensor([ids[1:]]), features[None, :-1], None, head.embed)
            logits.append(head.logits(out)[0])  # [n, K]
    error = (logits[1] - logits[0]).norm() / logits[0].norm()
    agree = (logits[1].argmax(-1) == logits[0].argmax(-1)).float().mean()
    assert error < 0.15 and agree >= 0.8, (float(error), float(agree))


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({"device": "cuda"}, "runs on a CPU in float32"),
        ({"dtype": "bfloat16"}, "runs on a CPU in float32"),
        ({"draft_kind": "llm"}, "applies to EAGLE heads"),
        ({"quantize": "int4"}, "quantize must be one of"),
    ],
)
def test_int8_is_refused_where_it_cannot_run(overrides: dict, why: str) -> None:
    """Catches ``--quantize int8`` accepted on a GPU or in half precision (PyTorch's dynamic
    quantization runs on CPUs in float32 only: the hub would fail at its first draft) or for a
    draft LLM (whose fused forward has no linear modules to swap: a silent no-op)."""
    config = {"model": "m", "draft_kind": "eagle3", "quantize": "int8"} | overrides
    with pytest.raises(ValueError, match=why):
        hub_module.HubConfig(**config)


def test_auto_stays_float_where_int8_cannot_run() -> None:
    """Catches auto choosing int8 on a GPU or in half precision (the hub would hand a CUDA or
    float16 head to PyTorch's dynamic quantization, which runs on CPUs in float32 only) or for a
    draft LLM."""
    assert hub_module.HubConfig(model="m", draft_kind="eagle3").int8_head
    assert not hub_module.HubConfig(model="m", draft_kind="eagle3", device="cuda").int8_head
    assert not hub_module.HubConfig(model="m", draft_kind="eagle", dtype="float16").int8_head
    assert not hub_module.HubConfig(model="m").int8_head
