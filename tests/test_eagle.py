"""The EAGLE-1 head (starsd/hub/drafters/eagle_head.py): checkpoint, caching, target weights."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from starsd import models
from starsd.hub.drafters.checkpoint import read_target_head
from starsd.hub.drafters.eagle_head import (
    EagleCache,
    EagleConfig,
    EagleHead,
    load_eagle_head,
    logits_from_features,
    save_eagle_head,
)

# The key names of a published EAGLE-1 head (e.g. yuhuili/EAGLE-Vicuna-7B-v1.3), hidden H,
# MLP I, heads h, KV heads kv, head dim d: shapes as functions of those.
EAGLE_KEYS = {
    "fc.weight": lambda c: (c["H"], 2 * c["H"]),
    "fc.bias": lambda c: (c["H"],),
    "layers.0.self_attn.q_proj.weight": lambda c: (c["h"] * c["d"], c["H"]),
    "layers.0.self_attn.k_proj.weight": lambda c: (c["kv"] * c["d"], c["H"]),
    "layers.0.self_attn.v_proj.weight": lambda c: (c["kv"] * c["d"], c["H"]),
    "layers.0.self_attn.o_proj.weight": lambda c: (c["H"], c["h"] * c["d"]),
    "layers.0.mlp.gate_proj.weight": lambda c: (c["I"], c["H"]),
    "layers.0.mlp.up_proj.weight": lambda c: (c["I"], c["H"]),
    "layers.0.mlp.down_proj.weight": lambda c: (c["H"], c["I"]),
    "layers.0.post_attention_layernorm.weight": lambda c: (c["H"],),
}


def target_config(target_dir: Path) -> dict[str, Any]:
    return json.loads((target_dir / "config.json").read_text())


def eagle_state(
    target_dir: Path, seed: int = 0, hidden: int | None = None
) -> dict[str, torch.Tensor]:
    """Random weights under exactly EAGLE's key names, shaped for the target."""
    cfg = target_config(target_dir)
    H = hidden or int(cfg["hidden_size"])
    h, kv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    shapes = {"H": H, "I": int(cfg["intermediate_size"]), "h": h, "kv": kv, "d": H // h}
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape(shapes), generator=generator) * 0.2
        for name, shape in EAGLE_KEYS.items()
    }


def write_head(
    root: Path,
    target_dir: Path,
    state: dict[str, torch.Tensor],
    fmt: str = "safetensors",
    **config_overrides: object,
) -> Path:
    """An EAGLE-layout head directory: Llama config.json (1 layer) + weights."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = target_config(target_dir)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg["rms_norm_eps"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "vocab_size": cfg["vocab_size"],
        "torch_dtype": "float16",
        **config_overrides,
    }
    (root / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file(state, str(root / "model.safetensors"))
    else:
        torch.save(state, root / "pytorch_model.bin")
    return root


@pytest.fixture(scope="module")
def head_dir(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_head(tmp_path_factory.mktemp("eagle"), target_dir, eagle_state(target_dir))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_eagle_layout_loads_with_its_key_names(target_dir: Path, tmp_path: Path, fmt: str) -> None:
    state = eagle_state(target_dir, seed=3)
    state_with_embed = {**state, "embed_tokens.weight": torch.zeros(5, 5)}  # accepted, ignored
    loaded = load_eagle_head(write_head(tmp_path, target_dir, state_with_embed, fmt), target_dir)
    own = loaded.head.state_dict()
    assert set(own) == set(EAGLE_KEYS)
    for name, tensor in state.items():
        assert torch.equal(own[name], tensor), name
    assert loaded.config.fc_bias


def test_missing_key_is_named(target_dir: Path, tmp_path: Path) -> None:
    state = eagle_state(target_dir)
    del state["layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing \['layers\.0\.mlp\.up_proj\.weight'\]"):
        load_eagle_head(write_head(tmp_path, target_dir, state), target_dir)


def test_unexpected_key_is_named(target_dir: Path, tmp_path: Path) -> None:
    # EAGLE's layer 0 has no input_layernorm: a checkpoint carrying one is not EAGLE-1's layout
    state = {**eagle_state(target_dir), "layers.0.input_layernorm.weight": torch.ones(64)}
    with pytest.raises(ValueError, match=r"unexpected \['layers\.0\.input_layernorm\.weight'\]"):
        load_eagle_head(write_head(tmp_path, target_dir, state), target_dir)


def test_hidden_size_mismatch_is_refused(target_dir: Path, tmp_path: Path) -> None:
    state = eagle_state(target_dir, hidden=32)
    with pytest.raises(ValueError, match="hidden size 32 != target hidden size 64"):
        load_eagle_head(write_head(tmp_path, target_dir, state, hidden_size=32), target_dir)


def test_vocab_mismatch_is_refused(target_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab"):
        load_eagle_head(
            write_head(tmp_path, target_dir, eagle_state(target_dir), vocab_size=7), target_dir
        )


def test_wrong_tensor_shape_is_refused(target_dir: Path, tmp_path: Path) -> None:
    state = eagle_state(target_dir)
    state["fc.weight"] = state["fc.weight"][:, :64].contiguous()
    with pytest.raises(ValueError, match=r"fc\.weight \(64, 64\) != \(64, 128\)"):
        load_eagle_head(write_head(tmp_path, target_dir, state), target_dir)


def test_bias_follows_config_or_checkpoint(target_dir: Path, tmp_path: Path) -> None:
    state = eagle_state(target_dir)
    del state["fc.bias"]
    loaded = load_eagle_head(write_head(tmp_path / "a", target_dir, state), target_dir)
    assert not loaded.config.fc_bias  # no "bias" key: inferred from the checkpoint
    with pytest.raises(ValueError, match=r"missing \['fc\.bias'\]"):
        load_eagle_head(write_head(tmp_path / "b", target_dir, state, bias=True), target_dir)


class Smuggled:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("pickle code ran",))


def test_pickle_with_code_is_not_executed(target_dir: Path, tmp_path: Path) -> None:
    write_head(tmp_path, target_dir, eagle_state(target_dir), fmt="bin")
    with (tmp_path / "pytorch_model.bin").open("wb") as handle:
        pickle.dump({"fc.weight": Smuggled()}, handle, protocol=2)
    with pytest.raises(pickle.UnpicklingError):
        load_eagle_head(tmp_path, target_dir)


def test_cached_incremental_forward_equals_full(target_dir: Path, head_dir: Path) -> None:
    eagle = load_eagle_head(head_dir, target_dir)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, eagle.config.vocab_size, (13,), generator=generator)  # [n]
    feats = torch.randn(13, eagle.config.hidden_size, generator=generator)  # [n, H]
    with torch.inference_mode():
        full = eagle.head(ids, feats, None, eagle.target.embed)  # [n, H]
    cache = eagle.new_cache()
    pieces, start = [], 0
    for size in (5, 1, 3, 1, 1, 2):
        pieces.append(eagle.forward(ids[start : start + size], feats[start : start + size], cache))
        start += size
    assert cache.length == 13
    torch.testing.assert_close(torch.cat(pieces), full, atol=1e-5, rtol=1e-5)
    # the output depends on the cached context: a fresh cache gives a different answer
    alone = eagle.forward(ids[-2:], feats[-2:], eagle.new_cache())
    assert not torch.allclose(alone, full[-2:], atol=1e-3)


def test_crop_then_refeed_equals_fresh(target_dir: Path, head_dir: Path) -> None:
    eagle = load_eagle_head(head_dir, target_dir)
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, eagle.config.vocab_size, (10,), generator=generator)
    feats = torch.randn(10, eagle.config.hidden_size, generator=generator)
    other_ids = torch.randint(0, eagle.config.vocab_size, (4,), generator=generator)
    other_feats = torch.randn(4, eagle.config.hidden_size, generator=generator)
    cache = eagle.new_cache()
    eagle.forward(ids, feats, cache)
    cache.crop(6)
    assert cache.length == 6
    rolled = eagle.forward(other_ids, other_feats, cache)
    fresh_cache = eagle.new_cache()
    eagle.forward(ids[:6], feats[:6], fresh_cache)
    fresh = eagle.forward(other_ids, other_feats, fresh_cache)
    torch.testing.assert_close(rolled, fresh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.k, fresh_cache.k)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(11)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(-1)


def test_layer_matches_transformers_llama_without_input_norm(
    target_dir: Path, head_dir: Path
) -> None:
    """Rotary convention, GQA and the MLP equal HF Llama's layer with input_layernorm removed."""
    from transformers import LlamaConfig, LlamaModel

    eagle = load_eagle_head(head_dir, target_dir)
    cfg = target_config(target_dir)
    hf = LlamaModel(LlamaConfig(**{**cfg, "num_hidden_layers": 1})).eval()
    missing = hf.layers[0].load_state_dict(eagle.head.layers[0].state_dict(), strict=False)
    assert missing.missing_keys == ["input_layernorm.weight"] and not missing.unexpected_keys
    hf.layers[0].input_layernorm = torch.nn.Identity()
    hf.norm = torch.nn.Identity()
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, 9, eagle.config.hidden_size, generator=generator)  # [1, n, H]
    with torch.inference_mode():
        expected = hf(inputs_embeds=hidden).last_hidden_state[0]
        ours = eagle.head.layers[0](hidden, 0, None)[0]
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_fc_takes_embedding_first(target_dir: Path, head_dir: Path) -> None:
    eagle = load_eagle_head(head_dir, target_dir)
    H = eagle.config.hidden_size
    ids = torch.tensor([3, 5])
    feats = torch.randn(2, H)
    with torch.inference_mode():
        eagle.head.fc.weight[:, H:] = 0  # the feature half silenced: only the embedding counts
        a = eagle.forward(ids, feats, eagle.new_cache())
        b = eagle.forward(ids, torch.randn(2, H), eagle.new_cache())
        c = eagle.forward(torch.tensor([4, 6]), feats, eagle.new_cache())
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, c)


def test_unrolled_passes_equal_chain_drafting(target_dir: Path, head_dir: Path) -> None:
    eagle = load_eagle_head(head_dir, target_dir)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, eagle.config.vocab_size, (1, 12), generator=generator)
    feats = torch.randn(1, 12, eagle.config.hidden_size, generator=generator)
    with torch.inference_mode():
        passes = eagle.head.unrolled(ids, feats, eagle.target.embed, depth=3)
    torch.testing.assert_close(passes[0][0], eagle.head(ids[0], feats[0], None, eagle.target.embed))
    for committed in (2, 7):
        cache = eagle.new_cache()
        step = eagle.forward(ids[0, :committed], feats[0, :committed], cache)[-1:]
        for depth in (1, 2):
            step = eagle.forward(ids[0, committed + depth - 1 : committed + depth], step, cache)
            expected = passes[depth][0, committed + depth - 1 : committed + depth]
            scale = float(expected.abs().max())  # random weights: chained values grow large
            torch.testing.assert_close(step, expected, atol=1e-4 * scale, rtol=1e-4)


def test_save_then_load_round_trip(target_dir: Path, head_dir: Path, tmp_path: Path) -> None:
    eagle = load_eagle_head(head_dir, target_dir)
    save_eagle_head(eagle.head, eagle.config, tmp_path)
    again = load_eagle_head(tmp_path, target_dir)
    assert again.config == eagle.config
    for name, tensor in eagle.head.state_dict().items():
        assert torch.equal(again.head.state_dict()[name], tensor), name
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 1


def test_config_reads_transformers5_rope_and_defaults() -> None:
    base = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "vocab_size": 9}
    plain = EagleConfig.from_json(base)
    assert (plain.head_dim, plain.num_key_value_heads, plain.rope_theta) == (16, 4, 10000.0)
    assert plain.fc_bias
    nested = EagleConfig.from_json({**base, "rope_parameters": {"rope_theta": 5e5}})
    assert nested.rope_theta == 5e5
    assert EagleConfig.from_json({**base, "rope_theta": 123.0}).rope_theta == 123.0
    with pytest.raises(ValueError, match="one decoder layer"):
        EagleConfig.from_json({**base, "num_hidden_layers": 2})
    with pytest.raises(ValueError, match="rotary scaling"):
        EagleConfig.from_json({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4}})


def _untied_sharded_target(root: Path) -> Path:
    from tiny_models import build_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    tokenizer: Any = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(root, max_shard_size="100KB")
    tokenizer.save_pretrained(root)
    return root


def test_target_head_weights_match_transformers(target_dir: Path, tmp_path: Path) -> None:
    untied = _untied_sharded_target(tmp_path / "untied")
    assert (untied / "model.safetensors.index.json").exists()
    for directory, tied in ((target_dir, True), (untied, False)):
        weights = read_target_head(directory)
        model = models.load_causal_lm(directory).model
        assert weights.tied is tied
        assert weights.embed.dtype == torch.float32
        assert torch.equal(weights.embed, model.get_input_embeddings().weight)
        assert torch.equal(weights.lm_head, model.get_output_embeddings().weight)
    assert not torch.equal(read_target_head(untied).embed, read_target_head(untied).lm_head)
    assert read_target_head(target_dir, dtype="float16").lm_head.dtype == torch.float16


def test_features_are_post_norm_last_hidden_states(
    target_dir: Path, llama_target: models.LoadedModel
) -> None:
    """lm_head(hidden_states[-1]) equals the target's logits: what the target must send."""
    weights = read_target_head(target_dir)
    ids = models.encode_text(llama_target, "To be, or not to be, that is the question")
    logits = models.forward(llama_target, ids, models.new_cache(llama_target))  # [n, V]
    captured: list[torch.Tensor] = []
    last_layer = llama_target.model.model.layers[-1]
    hook = last_layer.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        with torch.inference_mode():
            out = llama_target.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    features = out.hidden_states[-1][0]  # [n, H]
    torch.testing.assert_close(logits_from_features(features, weights.lm_head), logits)
    # ...and not the last layer's output before the final norm
    pre = captured[0][0] if isinstance(captured[0], tuple) else captured[0]  # [1, n, H]
    assert not torch.allclose(logits_from_features(pre[0], weights.lm_head), logits, atol=1e-3)


def test_cache_starts_empty_with_head_shape() -> None:
    config = EagleConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=11,
    )
    cache = EagleCache(config, torch.float32, torch.device("cpu"))
    assert cache.length == 0 and tuple(cache.k.shape) == (2, 0, 8)
    head = EagleHead(config).eval()
    with torch.inference_mode():
        out = head(torch.tensor([1, 2, 3]), torch.randn(3, 32), cache, torch.randn(11, 32))
    assert tuple(out.shape) == (3, 32) and tuple(cache.v.shape) == (2, 3, 8)
