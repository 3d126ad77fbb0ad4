"""An EAGLE-3 draft head in plain torch: one decoder layer over three of the target's layers.

The hub runs it with :class:`starsd.hub.drafters.eagle.EagleProposer` (``--draft-kind
eagle3``), as it runs EAGLE-1 heads. It holds the head and the target's token embedding (read
tensor by tensor); it never loads the target. This module imports no transformers.

Features (what the target sends, :func:`starsd.llama.tapped`):
    ``g_j`` is the target's hidden states at the head's ``layer_ids`` (by default (2, L // 2,
    L - 3) for a target of L layers), side by side in that order: each is transformers'
    ``hidden_states[i]``, the residual stream ENTERING decoder layer i, before any norm.

Forward (SafeAILab/EAGLE ``eagle/model/cnets.py``; vLLM speculators ``models/eagle3``):
    * ``h = fc(g_j)`` (``Linear(len(ids) H_t, H)``, no bias), only for the target's features:
      the head's own outputs, fed back while chain drafting, are already H wide (EAGLE and
      SGLang tell the two apart by width, as here);
    * ``x = cat(input_layernorm(embed(x_{j+1})), hidden_norm(h))``: the embedding FIRST, 2H
      wide into q, k and v; ``r = h + o_proj(attention)`` (``norm_before_residual``: the
      residual is ``hidden_norm(h)`` instead); ``out = r + mlp(post_attention_layernorm(r))``;
    * draft logits ``lm_head(norm(out))`` over the draft vocabulary predict ``x_{j+2}``; ``out``
      (before the final norm) is the hidden state the next draft step takes.
    Rotary positions are the target's (pair j at position j), as EAGLE-1's here.

Checkpoints read (``config.json`` + ``model.safetensors`` or ``pytorch_model.bin``):
    * EAGLE's: a Llama config with ``draft_vocab_size``; weights ``midlayer.*``, ``fc.weight``,
      ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``;
    * speculators' (what vLLM serves): ``speculators_model_type: "eagle3"``, the layer under
      ``transformer_layer_config``, ``draft_vocab_size``, ``norm_before_residual``,
      ``target_hidden_size`` and ``eagle_aux_hidden_state_layer_ids`` at the top level; weights
      ``layers.0.*`` and the rest as EAGLE's.
    ``d2t`` holds offsets (target id = draft id + d2t[draft id]), ``t2d`` a [V] bool mask; both
    absent when the head predicts over the target's whole vocabulary. ``embed_tokens.weight``,
    when present, is the head's own embedding (needed when its width differs from the
    target's); otherwise the target's is used. Options this head does not implement
    (``norm_before_fc``, ``fc_norm``, ``norm_output``) are refused, not ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from starsd.batch import LayerBuffer
from starsd.hub.drafters.checkpoint import (
    CONFIG_NAME,
    SAFETENSORS_NAME,
    head_state,
    read_target_head,
    rope_theta_of,
)
from starsd.hub.drafters.head_layers import MLP, Attention, EagleCache, RMSNorm
from starsd.hub.drafters.vocab import DraftVocab
from starsd.models import DTYPES

SPECULATORS_TYPE = "eagle3"
EMBED_KEY = "embed_tokens.weight"
VOCAB_KEYS = ("d2t", "t2d")
UNSUPPORTED = ("norm_before_fc", "fc_norm", "norm_output")


def default_layer_ids(target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default taps for a target of ``target_layers`` layers: (2, L // 2, L - 3)."""
    ids = (2, target_layers // 2, target_layers - 3)
    if len(set(ids)) != 3 or min(ids) < 0:
        raise ValueError(
            f"a target of {target_layers} layers has no default EAGLE-3 layers {ids}: "
            "name them (eagle_aux_hidden_state_layer_ids)"
        )
    return ids


@dataclass(frozen=True)
class Eagle3Config:
    """Shape of an EAGLE-3 head and the target layers it reads."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False

    @classmethod
    def from_json(cls, data: Mapping[str, Any], target_layers: int) -> Eagle3Config:
        """Read EAGLE's or speculators' ``config.json`` (see the module docstring).

        Raises:
            ValueError: not an EAGLE-3 config, more than one layer, or an option not
                implemented here.
        """
        speculators = data.get("speculators_model_type")
        if speculators is not None and speculators != SPECULATORS_TYPE:
            raise ValueError(f"speculators_model_type {speculators!r} is not {SPECULATORS_TYPE!r}")
        layer = data["transformer_layer_config"] if speculators else data
        if "draft_vocab_size" not in data:
            raise ValueError("not an EAGLE-3 config: no draft_vocab_size")
        on = [key for key in UNSUPPORTED if data.get(key)]
        if on:
            raise ValueError(f"EAGLE-3 options not supported: {on}")
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise ValueError("an EAGLE-3 head has one decoder layer")
        return cls._of(layer, data, target_layers)

    @classmethod
    def _of(
        cls, layer: Mapping[str, Any], top: Mapping[str, Any], target_layers: int
    ) -> Eagle3Config:
        hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        ids = top.get("eagle_aux_hidden_state_layer_ids") or default_layer_ids(target_layers)
        return cls(
            hidden_size=hidden,
            intermediate_size=int(layer["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads),
            target_hidden_size=int(top.get("target_hidden_size") or hidden),
            vocab_size=int(layer["vocab_size"]),
            draft_vocab_size=int(top["draft_vocab_size"]),
            layer_ids=tuple(int(i) for i in ids),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta_of(layer),
            max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
            norm_before_residual=bool(top.get("norm_before_residual", False)),
        )

    def to_json(self) -> dict[str, Any]:
        """speculators' layout (what vLLM loads), which :meth:`from_json` reads back."""
        layer = {
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
        }
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": SPECULATORS_TYPE,
            "transformer_layer_config": layer,
            "draft_vocab_size": self.draft_vocab_size,
            "norm_before_residual": self.norm_before_residual,
            "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.layer_ids),
        }


class Eagle3Layer(nn.Module):
    """The decoder layer: attention over [norm(embedding), norm(hidden)], then the MLP."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, in_features=2 * hidden)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.norm_before_residual = config.norm_before_residual

    def mix(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input [..., 2H], residual [..., H]) of embeddings and hidden states."""
        normed = self.hidden_norm(hidden)
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        return x, normed if self.norm_before_residual else hidden

    def finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output: the attention's residual, then the MLP's."""
        r = residual + attended
        return r + self.mlp(self.post_attention_layernorm(r))

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, start: int, cache: EagleCache | None
    ) -> torch.Tensor:
        """[B, n, H] x 2 -> [B, n, H] at positions ``start..`` (a cache: one sequence)."""
        x, residual = self.mix(embeds, hidden)
        return self.finish(residual, self.self_attn(x, start, cache))

    def forward_buffered(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None,
        buffer: LayerBuffer,
    ) -> torch.Tensor:
        """The layer over a ragged batch (see :meth:`Attention.forward_buffered`)."""
        x, residual = self.mix(embeds, hidden)
        return self.finish(
            residual, self.self_attn.forward_buffered(x, positions, key_mask, buffer)
        )


class Eagle3Head(nn.Module):
    """fc over the target's layers, one decoder layer, a final norm and the draft LM head."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        width = len(config.layer_ids) * config.target_hidden_size
        self.fc = nn.Linear(width, config.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(config)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)

    @property
    def layer(self) -> Eagle3Layer:
        return self.layers[0]  # type: ignore[return-value]

    def hidden_in(self, features: torch.Tensor) -> torch.Tensor:
        """The layer's hidden input: fc of the target's features, the head's own as they are."""
        return features if features.shape[-1] == self.config.hidden_size else self.fc(features)

    def forward(
        self,
        token_ids: torch.Tensor,
        features: torch.Tensor,
        cache: EagleCache | None,
        embed: torch.Tensor,
    ) -> torch.Tensor:
        """Outputs [B, n, H] (before the final norm) for pairs (features[j], token_ids[j]) after
        the cache (None: whole sequences from position 0)."""
        start = 0 if cache is None else cache.length
        embeds = embed[token_ids].to(features.dtype)  # [B, n, H]
        return self.layer(embeds, self.hidden_in(features), start, cache)

    def forward_buffered(
        self,
        token_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None,
        buffer: LayerBuffer,
        embed: torch.Tensor,
    ) -> torch.Tensor:
        """Outputs [B, n, H] of a ragged batch, appended to ``buffer`` in place."""
        embeds = embed[token_ids].to(features.dtype)  # [B, n, H]
        hidden = self.hidden_in(features)
        return self.layer.forward_buffered(embeds, hidden, positions, key_mask, buffer)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., K] of layer outputs [..., H]."""
        return self.lm_head(self.norm(out))

    def unrolled(
        self, token_ids: torch.Tensor, features: torch.Tensor, embed: torch.Tensor, depth: int
    ) -> list[torch.Tensor]:
        """Training-time test: ``depth`` passes over whole sequences [B, n], no cache.

        Pass 0 takes the target's features; pass p >= 1 takes pass p-1's output at row j - 1
        as row j's hidden state (the token stays the true x_{j+1}), and its query at j sees the
        keys chain drafting would: real pairs up to j - p, then pass m's pair at j - p + m for
        m = 1..p. Pass p's output at row j is the (p+1)-th chained step; rows j < p are not
        meaningful. Returns ``depth`` outputs [B, n, H] (logits: :meth:`logits`).
        """
        attn, n = self.layer.self_attn, token_ids.shape[1]
        embeds = embed[token_ids].to(features.dtype)  # [B, n, H]
        rows = torch.arange(n, device=token_ids.device)[:, None]  # [n, 1]
        cols = torch.arange(n, device=token_ids.device)[None, :]  # [1, n]
        hidden = self.fc(features)  # [B, n, H]
        outs: list[torch.Tensor] = []
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for p in range(depth):
            if p:
                hidden = torch.cat([hidden[:, :1], outs[-1][:, :-1]], dim=1)
            x, residual = self.layer.mix(embeds, hidden)
            q, k, v = attn.qkv(x, 0)
            keys.append(k)
            values.append(v)
            masks = [cols <= rows - p] + [cols == rows - p + m for m in range(1, p + 1)]
            allowed = torch.cat(masks, dim=1)  # [n, (p + 1) n]
            out = attn.attend(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), allowed)
            outs.append(self.layer.finish(residual, out))
        return outs


@dataclass(frozen=True)
class LoadedEagle3:
    """An EAGLE-3 head ready to draft for one target (what :class:`EagleProposer` drives)."""

    head: Eagle3Head
    config: Eagle3Config
    embed: torch.Tensor  # [V, H]: the head's own or the target's
    vocab: DraftVocab | None  # None: the head predicts over the target's whole vocabulary
    dtype: torch.dtype
    device: torch.device
    kind: str = "eagle3"

    @property
    def feature_width(self) -> int:
        """Width of one feature row the target sends: its hidden states at the layer ids."""
        return len(self.config.layer_ids) * self.config.target_hidden_size

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.layer_ids

    @property
    def kv_shapes(self) -> list[tuple[int, int]]:
        """(kv heads, head dim) of the head's one layer, as :mod:`starsd.batch` wants them."""
        return [(self.config.num_key_value_heads, self.config.head_dim)]

    def new_cache(self) -> EagleCache:
        """An empty cache for one sequence."""
        return EagleCache(self.config, self.dtype, self.device)

    @torch.inference_mode()
    def forward_batch(
        self,
        token_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        key_mask: torch.Tensor | None,
        buffer: LayerBuffer,
    ) -> torch.Tensor:
        """Outputs [B, n, H] of a ragged batch (see :mod:`starsd.batch`)."""
        ids = token_ids.to(device=self.device, dtype=torch.long)  # [B, n]
        feats = features.to(device=self.device, dtype=self.dtype)
        return self.head.forward_buffered(ids, feats, positions, key_mask, buffer, self.embed)

    @torch.inference_mode()
    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., K] (float32) of outputs [..., H]."""
        return self.head.logits(out).float()


def _state_of(head_root: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under this module's names (EAGLE's ``midlayer.`` ->
    ``layers.0.``)."""
    state = head_state(head_root)
    return {
        ("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
        for k, v in state.items()
    }


def _check_state(head: Eagle3Head, state: Mapping[str, torch.Tensor], where: Path) -> None:
    expected = dict(head.state_dict())
    extra = set(VOCAB_KEYS) | {EMBED_KEY}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected) - extra)
    if missing or unexpected:
        raise ValueError(f"{where}: EAGLE-3 head keys: missing {missing}, unexpected {unexpected}")
    wrong = [
        f"{name} {tuple(state[name].shape)} != {tuple(t.shape)}"
        for name, t in expected.items()
        if tuple(state[name].shape) != tuple(t.shape)
    ]
    if wrong:
        raise ValueError(f"{where}: EAGLE-3 head tensor shapes differ from its config: {wrong}")


def _vocab_of(state: Mapping[str, torch.Tensor], config: Eagle3Config) -> DraftVocab | None:
    """The draft vocabulary of ``d2t`` / ``t2d`` (None: the target's whole vocabulary)."""
    if "d2t" not in state:
        if config.draft_vocab_size != config.vocab_size:
            raise ValueError(
                f"a draft vocabulary of {config.draft_vocab_size} tokens needs d2t "
                f"(the target has {config.vocab_size})"
            )
        return None
    if state["d2t"].numel() != config.draft_vocab_size:
        raise ValueError(f"d2t has {state['d2t'].numel()} ids, not {config.draft_vocab_size}")
    return DraftVocab.from_offsets(state["d2t"], config.vocab_size, state.get("t2d"))


def check_fits_target(config: Eagle3Config, target: Mapping[str, Any], where: Path) -> None:
    """Refuse a head that does not fit the target's config: width, layers or vocabulary."""
    layers = int(target["num_hidden_layers"])
    width = int(target["hidden_size"])
    problems = []
    if config.target_hidden_size != width:
        problems.append(f"it reads hidden states {config.target_hidden_size} wide, not {width}")
    if not all(0 <= i <= layers for i in config.layer_ids):
        problems.append(f"layer ids {list(config.layer_ids)} are outside 0..{layers}")
    if len(set(config.layer_ids)) != len(config.layer_ids):
        problems.append(f"layer ids {list(config.layer_ids)} repeat")
    if config.vocab_size != int(target["vocab_size"]):
        problems.append(
            f"its vocabulary is {config.vocab_size}, the target's {target['vocab_size']}"
        )
    if problems:
        raise ValueError(f"{where} does not fit its target: " + "; ".join(problems))


def load_eagle3_head(
    head_dir: str | Path, target_dir: str | Path, dtype: str = "float32", device: str = "cpu"
) -> LoadedEagle3:
    """Load an EAGLE-3 head (either layout) for the target at ``target_dir``.

    Raises:
        ValueError: a config that is not EAGLE-3's or asks for what is not implemented, keys
            missing or unexpected (named), shapes that differ from the config, or a head that
            does not fit the target (hidden width, layer ids, vocabulary, its d2t / t2d).
    """
    head_root, target_root = Path(head_dir), Path(target_dir)
    target = read_target_head(target_root, dtype=dtype, device=device)
    raw = json.loads((head_root / CONFIG_NAME).read_text())
    config = Eagle3Config.from_json(raw, int(target.config["num_hidden_layers"]))
    check_fits_target(config, target.config, head_root)
    state = _state_of(head_root)
    head = Eagle3Head(config)
    _check_state(head, state, head_root)
    vocab = _vocab_of(state, config)
    embed = state.get(EMBED_KEY, target.embed).to(device=device, dtype=DTYPES[dtype])
    if tuple(embed.shape) != (config.vocab_size, config.hidden_size):
        raise ValueError(
            f"{head_root}: the head is {config.hidden_size} wide and has no embedding of its "
            f"own; the target's is {tuple(embed.shape)}"
        )
    head.load_state_dict({k: v for k, v in state.items() if k in head.state_dict()})
    head.to(device=device, dtype=DTYPES[dtype]).eval()
    return LoadedEagle3(head, config, embed, vocab, DTYPES[dtype], torch.device(device))


def save_eagle3_head(
    head: Eagle3Head,
    vocab: DraftVocab | None,
    out_dir: str | Path,
    dtype: str = "float32",
) -> Path:
    """Write speculators' layout (``config.json``, ``model.safetensors``) to ``out_dir``."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in head.state_dict().items()
    }
    if vocab is not None:
        state["d2t"] = (vocab.d2t - torch.arange(vocab.size)).contiguous()
        state["t2d"] = (vocab.t2d >= 0).contiguous()
    save_file(state, str(root / SAFETENSORS_NAME), metadata={"format": "pt"})
    (root / CONFIG_NAME).write_text(json.dumps(head.config.to_json(), indent=2) + "\n")
    return root
