"""An EAGLE-1 draft head in plain torch: one decoder layer that extrapolates the target's features.

The hub runs this instead of a separate draft LLM (:mod:`starsd.hub.drafters.eagle` drafts with
it). It holds only the head (a few hundred KB) and the target's token embedding and LM head, read
tensor by tensor with ``safetensors.safe_open`` so the hub never loads the whole target. Its
rotary embedding, attention and norm are :mod:`starsd.llama`'s, the ones the draft LLM and the
target run; the projections are ``nn.Linear`` modules, so training uses the same forward. This
module imports no transformers.

Feature semantics (what the target must send):
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
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from starsd.batch import LayerBuffer
from starsd.llama import attention, default_inv_freq, rms_norm, rotary, rotate_half
from starsd.models import DTYPES  # one dtype table for every model we load

EMBED_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"
IGNORED_HEAD_KEYS = frozenset({"embed_tokens.weight"})
SAFETENSORS_NAME = "model.safetensors"
PYTORCH_NAME = "pytorch_model.bin"
CONFIG_NAME = "config.json"


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
            rope_theta=_rope_theta(data),
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


def _rope_theta(data: Mapping[str, Any]) -> float:
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


class EagleCache:
    """KV cache of one sequence for the head's single layer: k, v are [kv_heads, T, head_dim]."""

    def __init__(self, config: EagleConfig, dtype: torch.dtype, device: torch.device) -> None:
        shape = (config.num_key_value_heads, 0, config.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [kv, T, d]
        self.v = torch.empty(shape, dtype=dtype, device=device)  # [kv, T, d]

    @property
    def length(self) -> int:
        """Number of positions (input pairs) held."""
        return int(self.k.shape[1])

    def crop(self, length: int) -> None:
        """Keep exactly the first ``length`` positions (an absolute length, not a count to drop).

        Raises:
            ValueError: if ``length`` is negative or longer than the cache.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        self.k = self.k[:, :length]
        self.v = self.v[:, :length]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new keys/values [kv, n, d]; returns the whole cache's (k, v)."""
        self.k = torch.cat([self.k, k], dim=1)
        self.v = torch.cat([self.v, v], dim=1)
        return self.k, self.v


class RMSNorm(nn.Module):
    """Llama's RMSNorm (computed in float32, scaled by a learned weight)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x``."""
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Llama self-attention with grouped KV heads, no biases, and a KV cache."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        hidden, heads, kv, dim = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        if heads % kv:
            raise ValueError(f"{heads} attention heads do not divide into {kv} KV heads")
        self.q_proj = nn.Linear(hidden, heads * dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv * dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)
        # float32 whatever the head's dtype (a plain attribute: .to(dtype) leaves it alone)
        self.inv_freq = default_inv_freq(dim, config.rope_theta)

    def qkv(
        self, x: torch.Tensor, start: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q [B, h, n, d] and k, v [B, kv, n, d] of ``x`` [B, n, H] at positions
        ``start..`` (or at ``start`` itself, per-row positions [B, n])."""
        c = self.config
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        if isinstance(start, int):
            positions = torch.arange(start, start + n, device=x.device)[None]  # [1, n]
        else:
            positions = start.to(x.device)  # [B, n]: one row per sequence
        cos, sin = rotary(positions, self.inv_freq.to(x.device), x.dtype)  # [B | 1, 1, n, d]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """Output [B, n, H] of q [B, h, n, d] over k, v [B, kv, T, d] where allowed [n, T]
        (or [B, 1, n, T]): :func:`starsd.llama.attention`, then the output projection."""
        b, _, n, _ = q.shape
        mask = allowed[None, None] if allowed.dim() == 2 else allowed  # [B | 1, 1, n, T]
        out = attention(q, k, v, mask, self.config.head_dim**-0.5)  # [B, n, h, d]
        return self.o_proj(out.reshape(b, n, -1))  # [B, n, H]

    def forward(self, x: torch.Tensor, start: int, cache: EagleCache | None) -> torch.Tensor:
        """Attend ``x`` [B, n, H] at positions ``start..start+n-1`` over the cache and itself.

        A cache (one sequence) needs B == 1.
        """
        b, n, _ = x.shape
        q, k, v = self.qkv(x, start)
        if cache is not None:
            if b != 1:
                raise ValueError(f"a cached forward takes one sequence, got a batch of {b}")
            whole_k, whole_v = cache.append(k[0], v[0])  # [kv, T, d], T = start + n
            k, v = whole_k[None], whole_v[None]
        positions = torch.arange(start, start + n, device=x.device)
        keys = torch.arange(k.shape[2], device=x.device) + (start + n - k.shape[2])
        return self.attend(q, k, v, keys[None, :] <= positions[:, None])  # mask [n, T]

    def forward_buffered(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None,
        buffer: LayerBuffer,
    ) -> torch.Tensor:
        """Attend a ragged batch ``x`` [B, n, H] at ``positions`` [B, n] over ``buffer``, whose
        columns are real keys where ``key_mask`` [B, T] is 1 (every column when None; see
        :mod:`starsd.batch`)."""
        n = x.shape[1]
        q, k, v = self.qkv(x, positions)
        first = buffer.filled
        keys, values = buffer.append(k, v)  # [B, kv, T, d]
        columns = torch.arange(keys.shape[2], device=x.device)
        causal = columns[None, :] <= first + torch.arange(n, device=x.device)[:, None]  # [n, T]
        if key_mask is None:  # no padding: the causal mask alone
            return self.attend(q, keys, values, causal)  # mask [n, T]
        allowed = causal[None, None] & key_mask.to(x.device).bool()[:, None, None, :]
        return self.attend(q, keys, values, allowed)  # mask [B, 1, n, T]


class MLP(nn.Module):
    """Llama's SiLU-gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``x`` [..., H]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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


@dataclass(frozen=True)
class LoadedEagle:
    """An EAGLE head ready to draft for one target, plus that target's embedding and LM head."""

    head: EagleHead
    config: EagleConfig
    target: TargetHeadWeights
    dtype: torch.dtype
    device: torch.device

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


def _head_state(head_dir: Path) -> dict[str, torch.Tensor]:
    safetensors_path = head_dir / SAFETENSORS_NAME
    if safetensors_path.exists():
        with safe_open(str(safetensors_path), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    bin_path = head_dir / PYTORCH_NAME
    if bin_path.exists():
        state = torch.load(bin_path, map_location="cpu", weights_only=True)
        return dict(state)
    raise ValueError(f"{head_dir}: no {SAFETENSORS_NAME} or {PYTORCH_NAME}")


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
    state = _head_state(head_root)
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
