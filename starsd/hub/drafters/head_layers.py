"""The pieces of an EAGLE draft head: Llama's norm, attention (with a KV cache) and MLP.

EAGLE-1 (:mod:`starsd.hub.drafters.eagle_head`) and EAGLE-3 (:mod:`starsd.hub.drafters.
eagle3_head`) build their one decoder layer from these. The math is :mod:`starsd.llama`'s (its
rotary embedding, attention and RMSNorm), the projections ``nn.Linear`` modules so that
training runs the same forward. No transformers.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from starsd.batch import LayerBuffer
from starsd.llama import attention, default_inv_freq, rms_norm, rotary, rotate_half


class HeadShape(Protocol):
    """What the layers read of a head's config."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def rope_theta(self) -> float: ...


class EagleCache:
    """KV cache of one sequence for the head's single layer: k, v are [kv_heads, T, head_dim]."""

    def __init__(self, config: HeadShape, dtype: torch.dtype, device: torch.device) -> None:
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

    def __init__(self, config: HeadShape, in_features: int | None = None) -> None:
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
        width = in_features or hidden  # EAGLE-3 attends over [embedding, hidden]: 2H wide
        self.q_proj = nn.Linear(width, heads * dim, bias=False)
        self.k_proj = nn.Linear(width, kv * dim, bias=False)
        self.v_proj = nn.Linear(width, kv * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)
        # float32 whatever the head's dtype (a plain attribute: .to(dtype) leaves it alone)
        self.inv_freq = default_inv_freq(dim, config.rope_theta)

    def qkv(
        self, x: torch.Tensor, start: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q [B, h, n, d] and k, v [B, kv, n, d] of ``x`` [B, n, in] at positions
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
        :mod:`starsd.batch`), causally; or where ``key_mask`` [B, n, T] bool, a token tree's
        whole mask, is True."""
        n = x.shape[1]
        q, k, v = self.qkv(x, positions)
        first = buffer.filled
        keys, values = buffer.append(k, v)  # [B, kv, T, d]
        if key_mask is not None and key_mask.dim() == 3:  # a token tree's mask [B, n, T], whole
            return self.attend(q, keys, values, key_mask.to(x.device).bool()[:, None])
        columns = torch.arange(keys.shape[2], device=x.device)
        causal = columns[None, :] <= first + torch.arange(n, device=x.device)[:, None]  # [n, T]
        if key_mask is None:  # no padding: the causal mask alone
            return self.attend(q, keys, values, causal)  # mask [n, T]
        allowed = causal[None, None] & key_mask.to(x.device).bool()[:, None, None, :]
        return self.attend(q, keys, values, allowed)  # mask [B, 1, n, T]


class MLP(nn.Module):
    """Llama's SiLU-gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: HeadShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``x`` [..., H]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
