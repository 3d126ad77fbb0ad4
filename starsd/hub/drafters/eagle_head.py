"""An EAGLE-1 draft head in plain torch: one decoder layer that extrapolates the target's features.

The hub runs this instead of a separate draft LLM (:mod:`starsd.hub.drafters.eagle` drafts with
it). It holds only the head (a few hundred KB) and the target's token embedding and LM head, read
tensor by tensor with ``safetensors.safe_open`` so the hub never loads the whole target. Its
rotary embedding, attention and norm are :mod:`starsd.llama`'s, the ones the draft LLM and the
target run; the projections are ``nn.Linear`` modules, so training uses the same forward. This
module imports no transformers.

Feature semantics (what the target must send: tap -1, :func:`starsd.llama.tapped`):
    The target's feature ``f_i`` at position ``i`` is its LAST hidden state AFTER the final norm,
    i.e. transformers' ``out.hidden_states[-1]`` with ``output_hidden_states=True`` (transformers
    5.x ``capture_outputs`` overwrites ``hidden_states[-1]`` with ``last_hidden_state``, which
    LlamaModel returns after ``self.norm``), so ``lm_head(f_i)`` are the target's logits at ``i``.
    EAGLE-1 uses the same tensor (``outputs[0]`` of the base model in ``ea_model.py``).
    The head's input ``j`` (at rotary position ``j``, counted from the first pair of the sequence)
    is the pair ``(f_j, x_{j+1})``; its output is ``f̂_{j+1}``, and the draft logits for
    ``x_{j+2}`` are ``lm_head(f̂_{j+1})``. Chain drafting feeds ``(f̂_{j+1}, x̂_{j+2})`` back in.

Architecture, checked against SafeAILab/EAGLE ``eagle/model/cnets1.py`` (EAGLE-1 ``Model``, the
``cnets.py`` of the same repository is EAGLE-3):
    * ``hidden = fc(cat((inputs_embeds, hidden_states), dim=-1))``: the token embedding comes FIRST,
      the feature second; ``fc = Linear(2H, H, bias=bias)`` where ``bias`` is the config's
      ``"bias"`` key, default True (``ea_model.py``).
    * one ``LlamaDecoderLayer(config, index=0)``; for index 0 there is NO ``input_layernorm``
      (``if self.index != 0``), but there is a ``post_attention_layernorm``; no final norm: the
      layer's output goes straight into the target's LM head.
    * attention is Llama's: q/k/v/o projections without bias (``qkv_bias`` only for Qwen heads),
      rotary embeddings with the ``rotate_half`` convention and ``cat((freqs, freqs))``, grouped
      KV heads, scale ``head_dim ** -0.5``; the MLP is ``down(silu(gate(x)) * up(x))``.
    * checkpoint keys: ``fc.weight``, ``fc.bias``, ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
      ``layers.0.post_attention_layernorm.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``;
      EAGLE checkpoints may also hold ``embed_tokens.weight`` (a copy of the target's embedding),
      which is accepted and ignored: the target's own embedding is used.
    * the config is a Llama ``config.json`` with ``num_hidden_layers: 1``; weights live in
      ``pytorch_model.bin`` (older releases) or ``model.safetensors``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from starsd.batch import LayerBuffer
from starsd.hub.drafters.checkpoint import (
    CONFIG_NAME,
    SAFETENSORS_NAME,
    TargetHeadWeights,
    head_state,
    read_target_head,
    rope_theta_of,
)
from starsd.hub.drafters.head_layers import MLP, Attention, EagleCache, RMSNorm
from starsd.models import DTYPES  # one dtype table for every model we load

IGNORED_HEAD_KEYS = frozenset({"embed_tokens.weight"})


@dataclass(frozen=True)
class EagleConfig:
    """Shape of an EAGLE-1 head (one Llama decoder layer behind an ``fc`` of width 2H -> H)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    vocab_size: int = 32000
    max_position_embeddings: int = 2048
    fc_bias: bool = True

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EagleConfig:
        """Read a Llama-style ``config.json`` dict as EAGLE publishes it for its heads.

        ``rope_theta`` may sit at the top level (transformers 4.x) or under ``rope_parameters`` /
        ``rope_scaling`` (transformers 5.x); only the default rotary type is supported. ``fc_bias``
        comes from EAGLE's ``"bias"`` key (default True, as in EAGLE's ``ea_model.py``).

        Raises:
            ValueError: for a head with more than one layer or an unsupported rotary scaling.
        """
        layers = int(data.get("num_hidden_layers", 1))
        if layers != 1:
            raise ValueError(f"an EAGLE-1 head has one decoder layer, config says {layers}")
        hidden = int(data["hidden_size"])
        heads = int(data["num_attention_heads"])
        head_dim = data.get("head_dim")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(data["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(head_dim) if head_dim else hidden // heads,
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta_of(data),
            vocab_size=int(data["vocab_size"]),
            max_position_embeddings=int(data.get("max_position_embeddings", 2048)),
            fc_bias=bool(data.get("bias", True)),
        )

    def to_json(self) -> dict[str, Any]:
        """A Llama-style config dict (``num_hidden_layers: 1``) that ``from_json`` reads back."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "bias": self.fc_bias,
            "tie_word_embeddings": False,
        }


class DecoderLayer(nn.Module):
    """EAGLE-1's layer 0: attention WITHOUT input_layernorm, then post-attention norm and MLP."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, start: int, cache: EagleCache | None) -> torch.Tensor:
        """x [B, n, H] -> [B, n, H]."""
        return self.feed_forward(x + self.self_attn(x, start, cache))

    def forward_buffered(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None,
        buffer: LayerBuffer,
    ) -> torch.Tensor:
        """The layer over a ragged batch (see :meth:`Attention.forward_buffered`)."""
        attended = self.self_attn.forward_buffered(x, positions, key_mask, buffer)
        return self.feed_forward(x + attended)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP half of the layer with its residual: x + mlp(norm(x))."""
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    """fc(cat(embed(x_{j+1}), f_j)) followed by one decoder layer; predicts f_{j+1}."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(config)])

    def forward(
        self,
        token_ids: torch.Tensor,
        features: torch.Tensor,
        cache: EagleCache | None,
        embed: torch.Tensor,
    ) -> torch.Tensor:
        """Predicted next features for pairs (features[j], token_ids[j]) after the cache.

        Args:
            token_ids: [n] (or [B, n]) long, ``x_{j+1}`` for each pair j.
            features: [n, H] (or [B, n, H]), ``f_j``: the target's post-norm last hidden state,
                or the head's own previous prediction when chain drafting.
            cache: appended to in place (positions ``cache.length ..``); None for a cacheless
                forward of whole sequences starting at position 0 (training).
            embed: [V, H] the target's token embedding.

        Returns:
            [n, H] (or [B, n, H]) predicted ``f_{j+1}``.
        """
        single = token_ids.dim() == 1
        ids = token_ids[None] if single else token_ids  # [B, n]
        feats = features[None] if single else features  # [B, n, H]
        start = 0 if cache is None else cache.length
        inputs = embed[ids].to(feats.dtype)  # [B, n, H]
        hidden = self.fc(torch.cat((inputs, feats), dim=-1))  # [B, n, H]
        out = self.layers[0](hidden, start, cache)  # [B, n, H]
        return out[0] if single else out

    def forward_buffered(
        self,
        token_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None,
        buffer: LayerBuffer,
        embed: torch.Tensor,
    ) -> torch.Tensor:
        """Predicted next features [B, n, H] of a ragged batch of pairs ``token_ids`` [B, n],
        ``features`` [B, n, H] at ``positions`` [B, n], appended to ``buffer`` in place."""
        inputs = embed[token_ids].to(features.dtype)  # [B, n, H]
        hidden = self.fc(torch.cat((inputs, features), dim=-1))  # [B, n, H]
        layer: DecoderLayer = self.layers[0]  # type: ignore[assignment]
        return layer.forward_buffered(hidden, positions, key_mask, buffer)

    def unrolled(
        self, token_ids: torch.Tensor, features: torch.Tensor, embed: torch.Tensor, depth: int
    ) -> list[torch.Tensor]:
        """Training-time chain drafting: ``depth`` passes over whole sequences, no cache.

        Pass 0 is the plain forward on real pairs (f_j, x_{j+1}). Pass p >= 1 feeds pass p-1's
        prediction for f_j in place of f_j, and its query at j sees exactly the keys chain
        drafting would: real pairs up to j-p, then pass m's pair at j-p+m for m = 1..p. Pass p's
        output at j is the head's (p+1)-th chained draft step; rows j < p are not meaningful.

        Args:
            token_ids: [B, n] long; features: [B, n, H]; embed: [V, H].

        Returns:
            ``depth`` tensors [B, n, H], pass p predicting f_{j+1} at row j.
        """
        layer: DecoderLayer = self.layers[0]  # type: ignore[assignment]
        attn = layer.self_attn
        inputs = embed[token_ids].to(features.dtype)  # [B, n, H]
        n = token_ids.shape[1]
        rows = torch.arange(n, device=token_ids.device)[:, None]  # [n, 1]
        cols = torch.arange(n, device=token_ids.device)[None, :]  # [1, n]
        outs: list[torch.Tensor] = []
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        feats = features
        for p in range(depth):
            if p:
                feats = torch.cat([features[:, :1], outs[-1][:, :-1]], dim=1)  # f̂_j at row j
            hidden = self.fc(torch.cat((inputs, feats), dim=-1))  # [B, n, H]
            q, k, v = attn.qkv(hidden, 0)
            keys.append(k)
            values.append(v)
            masks = [cols <= rows - p] + [cols == rows - p + m for m in range(1, p + 1)]
            allowed = torch.cat(masks, dim=1)  # [n, (p + 1) n]
            out = attn.attend(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), allowed)
            outs.append(layer.feed_forward(hidden + out))
        return outs


def logits_from_features(features: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """Logits [n, V] of features [n, H] through the target's LM head weight [V, H]."""
    return F.linear(features, lm_head.to(features.dtype))  # no transposed copy of [V, H]


@dataclass(frozen=True)
class LoadedEagle:
    """An EAGLE head ready to draft for one target, plus that target's embedding and LM head."""

    head: EagleHead
    config: EagleConfig
    target: TargetHeadWeights
    dtype: torch.dtype
    device: torch.device
    kind: str = "eagle"
    vocab: None = None  # drafts over the target's whole vocabulary, through its LM head
    feature_layers: tuple[int, ...] = ()  # the target's last hidden state

    @property
    def feature_width(self) -> int:
        """Width of one feature row the target sends: its last hidden state."""
        return self.config.hidden_size

    def new_cache(self) -> EagleCache:
        """An empty cache for one sequence."""
        return EagleCache(self.config, self.dtype, self.device)

    @torch.inference_mode()
    def forward(
        self, token_ids: list[int] | torch.Tensor, features: torch.Tensor, cache: EagleCache
    ) -> torch.Tensor:
        """Predicted features [n, H] for pairs (features[j], token_ids[j]) after the cache."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)  # [n]
        feats = features.to(device=self.device, dtype=self.dtype)  # [n, H]
        return self.head(ids, feats, cache, self.target.embed)

    @torch.inference_mode()
    def forward_batch(
        self,
        token_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None,
        buffer: LayerBuffer,
    ) -> torch.Tensor:
        """Predicted features [B, n, H] of a ragged batch (see :mod:`starsd.batch`)."""
        ids = token_ids.to(device=self.device, dtype=torch.long)  # [B, n]
        feats = features.to(device=self.device, dtype=self.dtype)  # [B, n, H]
        return self.head.forward_buffered(
            ids, feats, positions, key_mask, buffer, self.target.embed
        )

    @property
    def kv_shapes(self) -> list[tuple[int, int]]:
        """(kv heads, head dim) of the head's one layer, as :mod:`starsd.batch` wants them."""
        return [(self.config.num_key_value_heads, self.config.head_dim)]

    @torch.inference_mode()
    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft logits [n, V] (float32) of predicted features [n, H]."""
        return logits_from_features(features, self.target.lm_head).float()


def _check_keys(head: EagleHead, state: Mapping[str, torch.Tensor], where: Path) -> None:
    expected = dict(head.state_dict())
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected) - IGNORED_HEAD_KEYS)
    if missing or unexpected:
        raise ValueError(f"{where}: EAGLE head keys: missing {missing}, unexpected {unexpected}")
    wrong = [
        f"{name} {tuple(state[name].shape)} != {tuple(tensor.shape)}"
        for name, tensor in expected.items()
        if tuple(state[name].shape) != tuple(tensor.shape)
    ]
    if wrong:
        raise ValueError(f"{where}: EAGLE head tensor shapes differ from its config: {wrong}")


def load_eagle_head(
    head_dir: str | Path, target_dir: str | Path, dtype: str = "float32", device: str = "cpu"
) -> LoadedEagle:
    """Load an EAGLE-1 head directory (config.json + model.safetensors or pytorch_model.bin).

    ``pytorch_model.bin`` is read with ``torch.load(weights_only=True)`` from the local file only.
    When config.json has no ``"bias"`` key, ``fc`` has a bias iff the checkpoint has ``fc.bias``.

    Raises:
        ValueError: missing or unexpected keys (named), tensor shapes that differ from the config,
            or a hidden size or vocabulary that differs from the target's.
    """
    head_root, target_root = Path(head_dir), Path(target_dir)
    raw = json.loads((head_root / CONFIG_NAME).read_text())
    state = head_state(head_root)
    config = EagleConfig.from_json(raw)
    if "bias" not in raw:
        config = EagleConfig.from_json({**raw, "bias": "fc.bias" in state})
    target = read_target_head(target_root, dtype=dtype, device=device)
    if config.hidden_size != target.hidden_size:
        raise ValueError(
            f"EAGLE head hidden size {config.hidden_size} != target hidden size "
            f"{target.hidden_size} ({target_root})"
        )
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"EAGLE head vocab {config.vocab_size} != target vocab {target.vocab_size}"
        )
    head = EagleHead(config)
    _check_keys(head, state, head_root)
    head.load_state_dict({k: v for k, v in state.items() if k not in IGNORED_HEAD_KEYS})
    torch_dtype = DTYPES[dtype]
    head.to(device=device, dtype=torch_dtype).eval()
    return LoadedEagle(head, config, target, torch_dtype, torch.device(device))


def save_eagle_head(
    head: EagleHead, config: EagleConfig, out_dir: str | Path, dtype: str = "float32"
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (EAGLE key names) to ``out_dir``."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in head.state_dict().items()
    }
    save_file(state, str(root / SAFETENSORS_NAME), metadata={"format": "pt"})
    (root / CONFIG_NAME).write_text(json.dumps(config.to_json(), indent=2) + "\n")
    return root
