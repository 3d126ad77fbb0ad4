"""The plain-torch Llama forward (starsd/llama.py) against transformers' own forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from starsd import models
from starsd.batch import RaggedBatch, SequenceCache
from starsd.kvpool import KVPool, PooledRows
from starsd.llama import Packing, PaddedKeyValues

SEQS = [[5, 17, 33, 8, 9, 11, 40], [3, 4], [21, 22, 23, 24, 25]]
SPLIT = [4, 0, 3]  # cached part of each sequence before the batched feed


def _pair(llama_pair: tuple[Path, Path]) -> tuple[models.LoadedModel, models.LoadedModel]:
    """The tiny target (3 layers, 4 query heads over 2 KV heads) loaded both ways."""
    return models.load_causal_lm(llama_pair[0]), models.load_causal_lm(llama_pair[0], lean=False)


def _reference(loaded: models.LoadedModel, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits [n, V] and last hidden state [n, H] of ``ids`` from position 0."""
    return models.forward_with_features(loaded, ids, models.new_cache(loaded))


def test_a_plain_llama_gets_a_decoder_and_other_models_keep_transformers(
    llama_pair: tuple[Path, Path],
    gpt2_pair: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    """Catches the plain-torch path taken for a model whose math it does not implement (GPT-2;
    a Llama with scaled RoPE), or not taken for the plain Llama it exists for."""
    from transformers import AutoModelForCausalLM

    assert models.load_causal_lm(llama_pair[1]).decoder is not None
    assert models.load_causal_lm(llama_pair[1], lean=False).decoder is None
    assert models.load_causal_lm(gpt2_pair[1]).decoder is None
    model = AutoModelForCausalLM.from_pretrained(llama_pair[1])
    model.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    model.save_pretrained(tmp_path / "scaled")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "scaled" / name).write_bytes((llama_pair[1] / name).read_bytes())
    assert models.load_causal_lm(tmp_path / "scaled").decoder is None


def test_stacked_weights_are_shared_with_transformers_and_leave_its_forward_alone(
    llama_pair: tuple[Path, Path],
) -> None:
    """Catches a decoder that copies the weights (twice the model's memory) or a stacking that
    changes what transformers' own forward computes (its parameters become views)."""
    lean, plain = _pair(llama_pair)
    attn = lean.model.model.layers[0].self_attn
    qkv = lean.decoder.layers[0].qkv  # type: ignore[union-attr]
    assert attn.k_proj.weight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    ids = SEQS[0]
    torch.testing.assert_close(_reference(lean, ids)[0], _reference(plain, ids)[0], atol=0, rtol=0)


@pytest.mark.parametrize("packed", [False, True])
def test_a_padded_ragged_batch_equals_transformers_alone(
    llama_pair: tuple[Path, Path], packed: bool
) -> None:
    """Catches wrong RoPE positions, a causal or padding mask read the wrong way, grouped KV
    heads folded into the wrong query rows, and a decode step writing the wrong column: logits
    and features of a ragged batch (cached 4 / 0 / 3, one decode step after) must equal
    transformers' forward of each sequence alone. Packed (``fed`` given), it also catches real
    positions packed out of order or unpacked into another row's columns."""
    lean, _ = _pair(llama_pair)
    shapes = models.kv_shapes(lean)
    caches = [_prefilled(lean, seq[:c]) for seq, c in zip(SEQS, SPLIT, strict=True)]
    feeds = [s[c:] for s, c in zip(SEQS, SPLIT, strict=True)]
    batch = RaggedBatch(tuple(SPLIT), tuple(len(f) for f in feeds), 1)
    buffers = batch.gather(caches, shapes, torch.float32, lean.device)
    width = batch.cached_width + batch.fed_width
    logits, features = models.forward_batch(
        lean,
        batch.input_ids(feeds),
        batch.feed_positions(),
        PaddedKeyValues(buffers, batch.mask(width)),
        (-1,),
        fed=batch.fed if packed else None,
    )
    assert not packed or all(
        float(logits[i, len(f) :].abs().sum()) == 0 for i, f in enumerate(feeds)
    )
    nxt = torch.tensor([[1], [2], [3]])
    step, _ = models.forward_batch(
        lean, nxt, batch.step_positions(0), PaddedKeyValues(buffers, batch.mask(width + 1))
    )
    for i, seq in enumerate(SEQS):
        ref_logits, ref_features = _reference(lean, [*seq, int(nxt[i])])
        real = slice(0, len(feeds[i]))
        torch.testing.assert_close(
            logits[i, real], ref_logits[SPLIT[i] : len(seq)], atol=1e-5, rtol=1e-4
        )
        torch.testing.assert_close(
            features[i, real], ref_features[SPLIT[i] : len(seq)], atol=1e-5, rtol=1e-4
        )
        torch.testing.assert_close(step[i, 0], ref_logits[-1], atol=1e-5, rtol=1e-4)


def test_logits_at_one_column_per_row_are_that_columns_logits(
    llama_pair: tuple[Path, Path],
) -> None:
    """Catches ``logits_at`` picking another row's or another column's logits (the hub reads
    each row's last fed position, whatever the padding)."""
    lean, _ = _pair(llama_pair)
    feeds = [s[c:] for s, c in zip(SEQS, SPLIT, strict=True)]
    caches = [_prefilled(lean, seq[:c]) for seq, c in zip(SEQS, SPLIT, strict=True)]
    batch = RaggedBatch(tuple(SPLIT), tuple(len(f) for f in feeds), 0)
    args = (batch.input_ids(feeds), batch.feed_positions())

    def kv() -> PaddedKeyValues:
        buffers = batch.gather(caches, models.kv_shapes(lean), torch.float32, lean.device)
        return PaddedKeyValues(buffers, batch.mask(batch.capacity))

    every, _ = models.forward_batch(lean, *args, kv())
    picked, _ = models.forward_batch(lean, *args, kv(), logits_at=batch.last_fed())
    assert picked.shape == (3, 1, every.shape[-1])
    for i in range(3):
        torch.testing.assert_close(
            picked[i, 0], every[i, len(feeds[i]) - 1], atol=1e-5, rtol=1e-4
        )  # (another matmul shape: ulps apart)


@pytest.mark.parametrize("packed", [False, True])
def test_pooled_rows_equal_transformers_alone(llama_pair: tuple[Path, Path], packed: bool) -> None:
    """Catches the pooled path (every row in its slot of one KV tensor) writing keys at the
    wrong positions, a feed token seeing later feed tokens, or rows seeing each other (packed:
    the target's path, whose matmuls skip the padding)."""
    lean, _ = _pair(llama_pair)
    (heads, dim), layers = models.kv_shapes(lean)[0], len(models.kv_shapes(lean))
    caches = [_prefilled(lean, seq[:c]) for seq, c in zip(SEQS, SPLIT, strict=True)]
    feeds = [s[c:] for s, c in zip(SEQS, SPLIT, strict=True)]
    pool = KVPool((layers, heads, dim), torch.float32, lean.device)
    rows = PooledRows(pool, caches, [len(f) for f in feeds])
    layout = RaggedBatch(rows.start, rows.fed, 0)
    logits, _ = models.forward_batch(
        lean,
        layout.input_ids(feeds),
        layout.feed_positions(),
        rows,
        fed=rows.fed if packed else None,
    )
    for i, seq in enumerate(SEQS):
        ref_logits, _ = _reference(lean, seq)
        torch.testing.assert_close(
            logits[i, : len(feeds[i])], ref_logits[SPLIT[i] :], atol=1e-5, rtol=1e-4
        )


def test_packing_keeps_the_real_positions_in_row_order() -> None:
    """Catches a packing that keeps padding, drops or reorders real positions, or unpacks
    them into the wrong columns (the forward's matmuls would mix rows)."""
    x = torch.arange(12.0).view(3, 4, 1)  # [B 3, F 4, 1]
    packing = Packing([2, 4, 1], 4, x.device)
    packed = packing.pack(x)
    assert packed.squeeze(1).tolist() == [0.0, 1.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    back = packing.unpack(packed, 3).squeeze(2).tolist()
    assert back == [[0, 1, 0, 0], [4, 5, 6, 7], [8, 0, 0, 0]]
    full = Packing([4, 4, 4], 4, x.device)
    assert full.index is None and full.pack(x).shape == (12, 1)


def _prefilled(loaded: models.LoadedModel, ids: list[int]) -> SequenceCache:
    """A compact cache holding ``ids`` (empty for none), made by the batched forward."""
    if not ids:
        return SequenceCache()
    batch = RaggedBatch((0,), (len(ids),), 0)
    buffers = batch.gather(
        [SequenceCache()], models.kv_shapes(loaded), torch.float32, loaded.device
    )
    models.forward_batch(
        loaded, batch.input_ids([ids]), batch.feed_positions(), PaddedKeyValues(buffers, None)
    )
    return batch.scatter(buffers, 0, 0)


@pytest.mark.parametrize("groups", [1, 2])
def test_grouped_heads_attend_like_repeated_keys(groups: int) -> None:
    """Catches the fold of grouped query heads into their KV head's rows going wrong with a
    mask (the mask must be tiled per group in the query's row order)."""
    from starsd.llama import attention

    torch.manual_seed(0)
    b, kv, f, t, d = 2, 2, 3, 7, 4
    q = torch.randn(b, kv * groups, f, d)
    keys, values = torch.randn(b, kv, t, d), torch.randn(b, kv, t, d)
    allowed = torch.rand(b, 1, f, t) > 0.3
    allowed[..., 0] = True  # every query sees one key at least
    got = attention(q, keys, values, allowed, 0.5)  # [B, F, h, d]
    rep_k, rep_v = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    scores = (q @ rep_k.transpose(-1, -2) * 0.5).masked_fill(~allowed, float("-inf"))
    want = (torch.softmax(scores, -1) @ rep_v).transpose(1, 2)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    one = attention(q[:, :, :1], keys, values, allowed[:, :, :1], 0.5)  # the decode-step path
    torch.testing.assert_close(one, want[:, :1], atol=1e-6, rtol=1e-5)


def _attention_case(
    device: str = "cpu", dtype: torch.dtype = torch.float32, t: int = 9
) -> tuple[torch.Tensor, ...]:
    """q [2, 6, 3, 8] over keys / values [2, 2, t, 8] (grouped 3:1), a mask, and the
    float32 reference [B, F, h, d]."""
    torch.manual_seed(t)
    q, keys, values = torch.randn(2, 6, 3, 8), torch.randn(2, 2, t, 8), torch.randn(2, 2, t, 8)
    allowed = torch.rand(2, 1, 3, t) > 0.3
    allowed[..., 0] = True
    rep_k, rep_v = keys.repeat_interleave(3, 1), values.repeat_interleave(3, 1)
    scores = (q @ rep_k.transpose(-1, -2) * 0.5).masked_fill(~allowed, float("-inf"))
    want = (torch.softmax(scores, -1) @ rep_v).transpose(1, 2)
    moved = [x.to(device, dtype) for x in (q, keys, values)]
    return (*moved, allowed.to(device), want)


def test_attention_takes_sdpa_output_in_any_memory_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches attention assuming sdpa's output is contiguous: CUDA's memory-efficient kernel
    returns [B, h, F, d] values laid out as [B, F, h, d], which ``view`` refuses."""
    import torch.nn.functional as F

    from starsd.llama import attention

    real = F.scaled_dot_product_attention

    def transposed_layout(*args: object, **kwargs: object) -> torch.Tensor:
        out = real(*args, **kwargs)  # type: ignore[arg-type]
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other layout

    monkeypatch.setattr(F, "scaled_dot_product_attention", transposed_layout)
    q, keys, values, allowed, want = _attention_case()
    torch.testing.assert_close(attention(q, keys, values, allowed, 0.5), want)


def test_sdpa_on_cuda_leaves_out_cudnn_and_cpu_is_untouched() -> None:
    """Catches cuDNN's attention left selectable on CUDA: it builds a plan for every new key
    length, which a speculative round changes every round (45-570 ms a call on an H200)."""
    from starsd.llama import without_cudnn_attention

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with without_cudnn_attention(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
    with without_cudnn_attention(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_on_cuda_equals_the_reference_as_keys_grow(dtype: torch.dtype) -> None:
    """Catches the CUDA attention path (kernel choice, output layout) computing something else
    than the reference over the key lengths of successive rounds."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from starsd.llama import attention

    for t in range(100, 106):
        q, keys, values, allowed, want = _attention_case("cuda", dtype, t)
        got = attention(q, keys, values, allowed, 0.5).float().cpu()
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_an_unknown_forward_is_refused_at_start() -> None:
    """Catches a hub or target built in code with a misspelt forward, which would silently run
    transformers' forward instead of failing."""
    from edge.backends.torch import TorchBackend
    from starsd.hub.config import HubConfig

    with pytest.raises(ValueError, match="forward must be one of"):
        HubConfig(model="m", forward="plain")
    with pytest.raises(ValueError, match="forward must be one of"):
        TorchBackend.load("m", forward="plain")
