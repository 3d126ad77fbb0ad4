"""Int8 weights for an EAGLE head's projections on CPU (PyTorch's dynamic quantization).

Why: a hub drafts a few rows at a time, so each of the head's matrix products reads all of its
weights for a handful of rows. On a CPU those reads dominate, all the more when the target's
forward has just pushed the head out of the caches (a hub and a target on one machine). Int8
weights read a quarter of the bytes, and the products run on fbgemm's int8 kernels, with the
activations quantized per call. On the 2-core development machine the SmolLM2 EAGLE-3 head's
proposal of 2 tokens for one session fell from 13.8 to 10.5 ms cold, one of 2 tokens for 8
sessions from 23.3 to 17.4 ms, and its accepted drafts per round from 0.716 to 0.708 (16
held-out chats, gamma 2, centralized loop).

What stays float32: the EAGLE heads' ``fc``, which fuses the target's raw hidden states. Their
outlier channels are what per-call activation quantization clips: with ``fc`` in int8 too the
head accepted 0.655 drafts a round instead of 0.716. The embedding, the norms and EAGLE-1's
LM head (the target's own tensor, shared) are no linear modules and stay as loaded.

Lossless either way: the target verifies every draft token, and a sampled proposal carries the
quantized head's own q, the distribution it was drawn from.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Collection

from torch import nn

log = logging.getLogger("starsd.hub.drafters")

KEEP_FLOAT = frozenset({"fc"})  # the fusion of the target's raw hidden states (see above)


def quantize_linears(module: nn.Module, keep: Collection[str] = KEEP_FLOAT) -> list[str]:
    """Swap ``module``'s ``nn.Linear`` layers for int8 dynamically quantized ones, in place,
    all but those whose last name is in ``keep``; returns the names of those swapped.

    Per-channel int8 weights (a scale per output row), activations quantized per call.
    """
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    spec = {
        name: per_channel_dynamic_qconfig
        for name, layer in module.named_modules()
        if isinstance(layer, nn.Linear) and name.rsplit(".", 1)[-1] not in keep
    }
    with warnings.catch_warnings():  # torch.ao.quantization warns of its move to torchao
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        quantize_dynamic(module, spec, inplace=True)
    log.info("int8 weights for %d projections (%s kept float)", len(spec), ", ".join(keep))
    return sorted(spec)
