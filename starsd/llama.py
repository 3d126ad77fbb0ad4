"""A Llama decoder's cached forward in plain torch: the hub drafts and the target verifies with it.

transformers' Llama runs the same math through a dozen modules, decorators and cache objects per
layer. At StarSD's model sizes a forward is mostly that Python (1-2 layers of width 128: one
decode step took 0.9-1.0 ms through transformers and 0.5 ms here; the 20-layer default target
8.4-9.0 ms and 4.2 ms; one thread, same process, alternated), so the drafting engine and the
verifier call this instead wherever the model is a plain Llama (:func:`starsd.models.
load_causal_lm` decides, and falls back to transformers for anything else, e.g. GPT-2).

The math is transformers' ``LlamaForCausalLM`` op for op (RMSNorm in float32, rotate-half RoPE
from the model's own ``inv_freq``, SiLU-gated MLP, residuals in the same order), so greedy
output equals ``generate()``: the tests compare logits with transformers' forward and tokens
with ``generate()``. Two changes of layout, not of math: q/k/v are one matmul and gate/up one
(the weights are concatenated once, and transformers' own parameters are made views of them, so
the model's memory does not double), and a forward computes the LM head only where its caller
reads logits.

Where keys live is the caller's choice, through a :class:`KeyValues`: :class:`PaddedKeyValues`
(a gathered, padded batch; :mod:`starsd.batch`) or :class:`starsd.kvpool.PooledRows` (every row in
its slot of one pool). This module imports no transformers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from starsd.batch import LayerBuffer


@dataclass(frozen=True)
class LlamaLayer:
    """One decoder layer's weights, as ``F.linear`` takes them ([out, in])."""

    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(h + 2 kv) d, H]: q, k and v projections stacked
    qkv_bias: torch.Tensor | None  # [(h + 2 kv) d] (attention_bias models), else None
    o: torch.Tensor  # [H, h d]
    o_bias: torch.Tensor | None  # [H]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]: gate then up
    down: torch.Tensor  # [H, I]


@dataclass(frozen=True)
class LlamaShape:
    """Head counts and constants of the decoder."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float

    @property
    def scale(self) -> float:
        """Attention's score scale, head_dim ** -0.5 (Llama's)."""
        return float(self.head_dim**-0.5)


class KeyValues(Protocol):
    """Where a forward's keys and values go, and what each query attends over."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Store this layer's new k, v [B, kv, F, d]; attention of q [B, h, F, d] over each
        row's keys (its cached ones, then its feed, causal); returns [B, F, h, d]."""
        ...


@dataclass(frozen=True)
class LlamaDecoder:
    """The weights of a Llama causal LM, ready for :meth:`forward` (no transformers objects)."""

    shape: LlamaShape
    embed: torch.Tensor  # [V, H]
    layers: tuple[LlamaLayer, ...]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (the embedding itself when tied)
    inv_freq: torch.Tensor  # [d / 2] float32: RoPE's frequencies (the model's own buffer)
    rope_scale: float = 1.0  # transformers' attention_scaling of cos and sin (1 for default)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KeyValues,
        logits_at: torch.Tensor | None = None,
        taps: Sequence[int] = (),
        fed: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One cached forward of a ragged batch.

        Args:
            input_ids, positions: [B, F] long (padding included; ``kv`` knows what is real).
            kv: the cache the new keys go into and attention reads.
            logits_at: [B] feed column per row whose logits are wanted (the others are not
                computed), or None for every column.
            taps: hidden states to return as features, by transformers' ``hidden_states``
                index (:func:`tapped`; -1 the last): EAGLE-1 drafts from ``(-1,)``, EAGLE-3
                from three layers.
            fed: each row's real feed length (the rest of its F columns is padding), or None
                (every column computed). With it, the projections, the MLPs and the LM head
                run on the real positions only (:class:`Packing`).

        Returns:
            logits [B, F, V] (or [B, 1, V] with ``logits_at``; zero at padding), and
            [B, F, len(taps) H] float32 features (the taps side by side, in order) or None
            without taps.
        """
        b, f = input_ids.shape
        packing = Packing(fed, f, input_ids.device)
        taps = [i if i >= 0 else len(self.layers) + 1 + i for i in taps]  # -1: the last
        x = packing.pack(self.embed[input_ids])  # [N, H]: the real positions only
        cos, sin = rotary(positions, self.inv_freq, self.embed.dtype, self.rope_scale)
        states = {0: x} if 0 in taps else {}
        for index, layer in enumerate(self.layers):
            x = self._layer(index, layer, x, cos, sin, kv, packing)
            if index + 1 in taps:
                states[index + 1] = x
        out = rms_norm(x, self.norm, self.shape.eps)  # [N, H]
        states[len(self.layers)] = out  # (hidden_states[L] is after the final norm)
        features = tapped(states, taps)
        features = None if features is None else packing.unpack(features, b)
        if logits_at is not None:
            picked = packing.unpack(out, b)[torch.arange(b), logits_at][:, None]  # [B, 1, H]
            return F.linear(picked, self.lm_head).float(), features
        return packing.unpack(F.linear(out, self.lm_head).float(), b), features

    def _layer(
        self,
        index: int,
        layer: LlamaLayer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KeyValues,
        packing: Packing,
    ) -> torch.Tensor:
        """x [N, H] -> [N, H] (the real positions): attention (over the padded [B, F] layout
        the caches take) and MLP, each with its residual."""
        s = self.shape
        b, f = cos.shape[0], cos.shape[2]
        qkv = F.linear(rms_norm(x, layer.input_norm, s.eps), layer.qkv, layer.qkv_bias)
        q, k, v = (
            packing.unpack(qkv, b)
            .view(b, f, s.heads + 2 * s.kv_heads, s.head_dim)
            .transpose(1, 2)
            .split([s.heads, s.kv_heads, s.kv_heads], dim=1)
        )  # [B, h | kv | kv, F, d]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        attended = kv.attend(index, q, k, v, s.scale).reshape(b, f, s.heads * s.head_dim)
        x = x + F.linear(packing.pack(attended), layer.o, layer.o_bias)
        gate, up = F.linear(rms_norm(x, layer.post_norm, s.eps), layer.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.down)


class Packing:
    """The real positions of a padded feed [B, F]: what the position-wise matmuls compute.

    A batch mixing decode steps (1 position) with verifications (gamma + 1) pads every row to
    the longest; at widths where a CPU computes rather than waits on memory, a step padded to
    5 positions costs what a verification does (the target's 4 sequences: one step 98 ms, one
    with a single verify row of 2 positions padded to 8 positions 130 ms). Packed, the
    projections, the MLPs and the LM head run on the N real rows; attention keeps the padded
    layout its caches use (padding queries there read zeros and are dropped). Without padding
    (``fed`` None or every row full) packing is a reshape.
    """

    def __init__(self, fed: Sequence[int] | None, width: int, device: torch.device) -> None:
        self.width = width
        self.index: torch.Tensor | None = None  # flat [B F] indices of the real positions
        if fed is not None and any(n < width for n in fed):
            columns = torch.arange(width, device=device)
            real = columns[None, :] < torch.tensor(list(fed), device=device)[:, None]
            self.index = real.reshape(-1).nonzero().squeeze(1)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, F, ...] -> [N, ...]: the real positions, row by row."""
        flat = x.reshape(-1, *x.shape[2:])
        return flat if self.index is None else flat[self.index]

    def unpack(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """[N, ...] -> [B, F, ...] with zeros at the padding."""
        if self.index is not None:
            full = x.new_zeros(rows * self.width, *x.shape[1:])
            full[self.index] = x
            x = full
        return x.view(rows, self.width, *x.shape[1:])


def tapped(states: dict[int, torch.Tensor], taps: Sequence[int]) -> torch.Tensor | None:
    """The hidden states at ``taps`` side by side [..., len(taps) H] float32 (None: no taps).

    Index i < L is the residual stream entering decoder layer i (0: the token embeddings), L
    (or -1) the last hidden state after the final norm: transformers' ``hidden_states[i]`` with
    ``output_hidden_states=True``, so ``lm_head`` of tap L gives the logits."""
    if not taps:
        return None
    return torch.cat([states[i] for i in taps], dim=-1).float()


def rotary(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, F, d] at ``positions`` [B, F] (as transformers' LlamaRotaryEmbedding:
    float32 angles from ``inv_freq`` [d / 2], ``cat((freqs, freqs))``, times ``scale``)."""
    freqs = positions.to(inv_freq.device).float()[..., None] * inv_freq  # [B, F, d/2]
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, F, d]
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Llama's default RoPE frequencies [d / 2] float32 (transformers' default rope type)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float()
    return 1.0 / (theta ** (exponents / head_dim))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm of the last dimension, computed in float32 (transformers' order)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Swap and negate the two halves of the last dimension (Llama's rotary convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PaddedKeyValues:
    """:class:`KeyValues` over a gathered batch (:meth:`starsd.batch.RaggedBatch.gather`).

    Every row's keys sit in one padded buffer per layer; ``key_mask`` [B, T_max] (1: a real key,
    None: no padding) says which columns are real once this forward's columns are appended. Each
    fed query sees the real keys up to its own column. A token tree's forward instead gives the
    whole mask, [B, F, T] bool per query (True: attend; :class:`starsd.hub.drafters.tree_draft.
    TreeBatch`). Made once per forward: the mask is built at the first layer and shared by the
    others.
    """

    def __init__(self, buffers: Sequence[LayerBuffer], key_mask: torch.Tensor | None) -> None:
        self.buffers = buffers
        self.key_mask = key_mask
        self._allowed: torch.Tensor | None = None
        self._built = False

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """See :meth:`KeyValues.attend`."""
        first = self.buffers[layer].filled
        keys, values = self.buffers[layer].append(k, v)  # [B, kv, T, d]
        allowed = self._mask(first, q.shape[2], keys.shape[2], q.device)
        return attention(q, keys, values, allowed, scale)

    def _mask(
        self, first: int, fed: int, columns: int, device: torch.device
    ) -> torch.Tensor | None:
        """[B | 1, 1, F, T] bool (True: attend), or None when every query sees every key."""
        if not self._built and self.key_mask is not None and self.key_mask.dim() == 3:
            self._built = True  # a tree's mask, given whole
            self._allowed = self.key_mask[:, None, :, :columns].to(device=device, dtype=torch.bool)
        if not self._built:
            self._built = True
            causal = None
            if fed > 1:  # query j sits at column first + j and sees the columns up to it
                col = torch.arange(columns, device=device)
                causal = col[None, :] <= first + torch.arange(fed, device=device)[:, None]
            real = None
            if self.key_mask is not None:
                real = self.key_mask[:, :columns].to(device=device, dtype=torch.bool)
            if causal is not None and real is not None:
                self._allowed = causal[None, None] & real[:, None, None, :]
            elif causal is not None:
                self._allowed = causal[None, None]
            elif real is not None:
                self._allowed = real[:, None, None, :]
        return self._allowed


def attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """q [B, h, F, d] over keys / values [B, kv, T, d] where ``allowed`` [B | 1, 1, F, T]
    (None: everywhere) -> [B, F, h, d].

    Grouped KV heads attend without copying the cache: the ``h / kv`` query heads of a KV head
    are folded into its query rows. One query per row (a decode step) takes two batched matmuls,
    which on CPU beat sdpa's kernel for small heads; longer feeds take sdpa.
    """
    b, h, f, d = q.shape
    kv = keys.shape[1]
    group = h // kv
    q = q.reshape(b, kv, group * f, d)  # [B, kv, g F, d]: query heads of one KV head together
    if allowed is not None and group > 1:
        allowed = allowed.repeat(1, 1, group, 1) if f > 1 else allowed  # rows g F, as q's
    if f == 1:
        scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [B, kv, g, T]
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(weights, values)  # [B, kv, g, d]
    else:
        with without_cudnn_attention(q.device):
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=scale)
    return out.reshape(b, h, f, d).transpose(1, 2)  # [B, F, h, d] (sdpa kernels differ in layout)


# sdpa's kernels but cuDNN's: cuDNN's attention builds an execution plan for every new shape,
# and a speculative round's key length is new every round (on an H200 with torch 2.11, bf16:
# 45-570 ms a call against tens of microseconds for the memory-efficient kernel).
_SDPA_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def without_cudnn_attention(device: torch.device) -> AbstractContextManager[None]:
    """A context in which sdpa on ``device`` picks any kernel but cuDNN's (nothing on CPU)."""
    return sdpa_kernel(_SDPA_KERNELS) if device.type == "cuda" else contextlib.nullcontext()
