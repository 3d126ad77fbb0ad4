"""Model loading and the few model calls StarSD makes; the only module that imports transformers.

Any transformers causal-LM directory (or hub id, where the machine is online) loads through
:func:`load_causal_lm`, on the hub (draft, q) and on the target (p) alike.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from starsd.batch import LayerBuffer
from starsd.llama import (
    KeyValues,
    LlamaDecoder,
    LlamaLayer,
    LlamaShape,
    PaddedKeyValues,
    without_cudnn_attention,
)

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# --forward: "auto" runs a plain Llama through starsd.llama, "transformers" always transformers'
FORWARDS = ("auto", "transformers")
_REPO_ROOT = Path(__file__).resolve().parent.parent
_MODELS = _REPO_ROOT / "models"
# (target, draft LLM) directories by name. smollm2: SmolLM2-135M-Instruct (made by `make
# install`) and the draft trained for it; toy: the committed 3.5M/0.6M pair the fast tests run on.
PAIRS = {
    "smollm2": (_MODELS / "smollm2-135m-instruct", _MODELS / "smollm2-draft"),
    "toy": (_MODELS / "starsd-target", _MODELS / "starsd-draft"),
}
# Each pair's drafters by --draft-kind; the first is the hub's default for the pair: the one that
# ran fastest through one hub on the real pair (make bench-real: the EAGLE-3 head 1.10x the
# target alone, the draft LLM 0.98x).
DRAFTERS = {
    "smollm2": {
        "eagle3": _MODELS / "smollm2-eagle3",
        "llm": _MODELS / "smollm2-draft",
        "eagle": _MODELS / "smollm2-eagle",
    },
    "toy": {
        "llm": _MODELS / "starsd-draft",
        "eagle": _MODELS / "starsd-eagle",
        "eagle3": _MODELS / "starsd-eagle3",
    },
}
DEFAULT_PAIR = "smollm2"
DEFAULT_TARGET_DIR, DEFAULT_DRAFT_DIR = PAIRS[DEFAULT_PAIR]
TOY_TARGET_DIR, TOY_DRAFT_DIR = PAIRS["toy"]


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for cached forwards, with what the handshake needs to know about it."""

    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers tokenizer
    name: str
    vocab_size: int  # width of the logits
    tokenizer_fingerprint: str
    eos_token_ids: frozenset[int]
    max_positions: int | None
    device: torch.device
    # the plain-torch forward (starsd.llama) where the model is a plain Llama; None: transformers'
    decoder: LlamaDecoder | None = None


def load_causal_lm(
    path: str | Path, device: str = "cpu", dtype: str = "float32", lean: bool = True
) -> LoadedModel:
    """Load a causal LM and its tokenizer from a directory (or hub id) for inference.

    ``lean``: batched forwards of a plain Llama run through :mod:`starsd.llama` (its q/k/v and
    gate/up weights are stacked once, transformers' parameters becoming views of them); False
    keeps every forward in transformers (the ONNX export traces transformers' graph).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    _check_made(Path(str(path)))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype])
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=Path(str(path)).name or str(path),
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        eos_token_ids=_eos_ids(model, tokenizer),
        max_positions=_max_positions(model.config),
        device=torch.device(device),
        decoder=llama_decoder(model) if lean else None,
    )
    log.info(
        "loaded %s: %.2fM params, vocab %d, %s on %s, tokenizer %s, %s forward",
        loaded.name,
        sum(p.numel() for p in model.parameters()) / 1e6,
        loaded.vocab_size,
        dtype,
        device,
        loaded.tokenizer_fingerprint,
        "plain-torch Llama" if loaded.decoder is not None else "transformers",
    )
    return loaded


def _check_made(path: Path) -> None:
    """FileNotFoundError naming the set-up step when the converted default target is missing
    (every other model of the project is committed)."""
    if path.resolve() == DEFAULT_TARGET_DIR and not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path}: not made yet; `make install` converts and checks it "
            "(or pass --pair toy for the committed toy pair)"
        )


def llama_decoder(model: Any) -> LlamaDecoder | None:
    """The :class:`~starsd.llama.LlamaDecoder` of a transformers Llama, or None where its math
    is not exactly what :mod:`starsd.llama` computes (another architecture, RoPE scaling, a
    non-SiLU MLP, MLP biases, tensor-parallel slicing)."""
    config = model.config
    if config.model_type != "llama":
        return None
    rope: Any = getattr(model.model, "rotary_emb", None)
    supported = (
        config.hidden_act == "silu"
        and not getattr(config, "mlp_bias", False)
        and getattr(config, "pretraining_tp", 1) == 1
        and rope is not None
        and getattr(rope, "rope_type", "default") == "default"
    )
    if not supported:
        return None
    shape = LlamaShape(
        config.num_attention_heads,
        config.num_key_value_heads,
        int(rope.inv_freq.shape[0] * 2),
        float(config.rms_norm_eps),
    )
    return LlamaDecoder(
        shape=shape,
        embed=model.model.embed_tokens.weight.detach(),
        layers=tuple(_llama_layer(layer) for layer in model.model.layers),
        norm=model.model.norm.weight.detach(),
        lm_head=model.lm_head.weight.detach(),
        inv_freq=rope.inv_freq.detach().float(),
        rope_scale=float(getattr(rope, "attention_scaling", 1.0)),
    )


def _llama_layer(layer: Any) -> LlamaLayer:
    attn, mlp = layer.self_attn, layer.mlp
    qkv_bias = None
    if attn.q_proj.bias is not None:
        qkv_bias = _stack([attn.q_proj, attn.k_proj, attn.v_proj], "bias")
    return LlamaLayer(
        input_norm=layer.input_layernorm.weight.detach(),
        qkv=_stack([attn.q_proj, attn.k_proj, attn.v_proj], "weight"),
        qkv_bias=qkv_bias,
        o=attn.o_proj.weight.detach(),
        o_bias=None if attn.o_proj.bias is None else attn.o_proj.bias.detach(),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=_stack([mlp.gate_proj, mlp.up_proj], "weight"),
        down=mlp.down_proj.weight.detach(),
    )


def _stack(linears: list[Any], name: str) -> torch.Tensor:
    """The linears' ``name`` tensors stacked along dim 0, each linear's parameter then made a
    view of its rows (one copy of the weights in memory, transformers' forward unchanged)."""
    stacked = torch.cat([getattr(m, name).detach() for m in linears], dim=0)
    start = 0
    for m in linears:
        param = getattr(m, name)
        param.data = stacked[start : start + param.shape[0]]
        start += param.shape[0]
    return stacked


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of the vocabulary and special tokens: equal iff ids mean the same text."""
    return fingerprint_of(tokenizer.get_vocab(), tokenizer.all_special_tokens)


def fingerprint_of(vocab: dict[str, int], special: Any) -> str:
    """:func:`tokenizer_fingerprint` from a vocabulary and special tokens (no transformers: the
    ONNX Runtime backend recomputes it from ``tokenizer.json`` with the tokenizers library)."""
    items = sorted(vocab.items(), key=lambda kv: kv[1])
    blob = json.dumps([items, sorted(str(t) for t in special)], ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def _max_positions(config: Any) -> int | None:
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def new_cache(loaded: LoadedModel) -> Any:
    """An empty KV cache for one sequence."""
    from transformers import DynamicCache

    return DynamicCache(config=loaded.model.config)


def cache_length(cache: Any) -> int:
    """Number of positions held in ``cache``."""
    return int(cache.get_seq_length())


def crop_cache(cache: Any, length: int) -> None:
    """Roll ``cache`` back so it holds exactly the first ``length`` positions."""
    extra = cache_length(cache) - length
    if extra > 0:
        cache.crop(-extra)  # transformers 5.x: a negative count removes that many positions


def forward(loaded: LoadedModel, token_ids: list[int], cache: Any) -> torch.Tensor:
    """Feed ``token_ids`` after the cached prefix; logits [len(token_ids), V] float32 on CPU."""
    return _run(loaded, token_ids, cache, hidden=False).logits[0].float().cpu()


def forward_with_features(
    loaded: LoadedModel, token_ids: list[int], cache: Any, taps: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`forward`, plus features: the hidden states at ``taps`` side by side
    (:func:`starsd.llama.tapped`), by default EAGLE-1's, the last hidden state after the final
    norm (``lm_head(features) == logits``). Returns ([n, V], [n, len(taps) H]) float32 CPU."""
    out = _run(loaded, token_ids, cache, hidden=True)
    taps = (-1,) if taps is None else taps
    return out.logits[0].float().cpu(), _tapped(out.hidden_states, taps)[0]


def _tapped(hidden_states: Sequence[torch.Tensor], taps: Sequence[int]) -> torch.Tensor:
    """transformers' ``hidden_states`` at ``taps``, side by side, float32 on CPU."""
    return torch.cat([hidden_states[i] for i in taps], dim=-1).float().cpu()


@torch.inference_mode()
def _run(loaded: LoadedModel, token_ids: list[int], cache: Any, hidden: bool) -> Any:
    ids = torch.tensor([token_ids], dtype=torch.long, device=loaded.device)  # [1, n]
    with without_cudnn_attention(loaded.device):
        return loaded.model(
            input_ids=ids,
            **cache_arg(loaded.model, cache),
            use_cache=True,
            output_hidden_states=hidden,
        )


def cache_arg(model: Any, cache: Any) -> dict[str, Any]:
    """``cache`` as the keyword ``model``'s forward takes it: ``cache`` in transformers' newer
    5.x releases, ``past_key_values`` before them (an unknown keyword would be swallowed by the
    forward's ``**kwargs`` and the cache silently left empty)."""
    model_class: Any = type(model)
    return {_cache_keyword(model_class): cache}


@functools.cache
def _cache_keyword(model_class: Any) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def kv_shapes(loaded: LoadedModel) -> list[tuple[int, int]]:
    """(kv heads, head dim) of each layer's cache, read from a one-token probe forward (robust
    to how each architecture names its shapes)."""
    cache = new_cache(loaded)
    _run(loaded, [0], cache, hidden=False)
    return [(int(layer.keys.shape[1]), int(layer.keys.shape[3])) for layer in cache.layers]


def forward_batch(
    loaded: LoadedModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv: KeyValues,
    taps: Sequence[int] = (),
    logits_at: torch.Tensor | None = None,
    fed: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward of a ragged batch: every batched forward of the hub and the target.

    Args:
        input_ids: [B, n] long (each row's feed, then padding); positions: [B, n] position ids.
        kv: where the new keys go and what each row attends over: :class:`PaddedKeyValues`
            (gathered buffers and their key mask, :mod:`starsd.batch`) or
            :class:`starsd.kvpool.PooledRows` (every row in its pool slot; a plain Llama only).
        taps: hidden states to return as features (:func:`starsd.llama.tapped`); () none.
        logits_at: [B] the one feed column per row whose logits are wanted; None: all.
        fed: each row's real feed length; a plain Llama then computes its matmuls on the
            real positions only (:class:`starsd.llama.Packing`); None: every column.

    Returns:
        logits [B, n, V] ([B, 1, V] with ``logits_at``) float32 on CPU, and features
        [B, n, len(taps) H] with taps, else None.

    A plain Llama runs :mod:`starsd.llama` (one attention implementation, StarSD's); any other
    architecture runs transformers' forward with its own attention over the padded buffers.
    """
    if loaded.decoder is not None:
        logits, features = loaded.decoder.forward(
            input_ids.to(loaded.device),
            positions,
            kv,
            None if logits_at is None else logits_at.to(loaded.device),
            taps,
            fed,
        )
        return logits.cpu(), None if features is None else features.cpu()
    if not isinstance(kv, PaddedKeyValues):
        raise ValueError(f"{loaded.name} runs transformers' attention: it needs padded buffers")
    mask = _transformers_mask(kv, input_ids.shape[1], next(loaded.model.parameters()).dtype)
    with torch.inference_mode(), without_cudnn_attention(loaded.device):
        mask = None if mask is None else mask.to(loaded.device)
        out = loaded.model(
            input_ids=input_ids.to(loaded.device),
            **cache_arg(loaded.model, _buffer_cache(list(kv.buffers))),
            use_cache=True,
            attention_mask=mask,
            position_ids=positions.to(loaded.device),
            output_hidden_states=bool(taps),
        )
    features = _tapped(out.hidden_states, taps) if taps else None
    logits = out.logits if logits_at is None else _pick(out.logits, logits_at)
    return logits.float().cpu(), features


def _transformers_mask(kv: PaddedKeyValues, fed: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The attention mask transformers' forward takes for ``kv``: None without padding (its
    causal path), the key mask [B, T] (it adds the causal part), or, for a token tree's whole
    mask [B, F, T] bool, that mask as transformers takes a 4D one: as given, additive, over the
    keys there will be once this forward's ``fed`` columns are appended."""
    mask = kv.key_mask
    if mask is None or mask.dim() == 2:
        return mask
    keys = kv.buffers[0].filled + fed
    allowed = mask[:, None, :, :keys]  # [B, 1, F, T]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def _pick(logits: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """logits [B, n, V] at one column per row -> [B, 1, V]."""
    return logits[torch.arange(logits.shape[0]), columns.to(logits.device)][:, None]


def forward_explicit(
    model: Any,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    past: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, ...]:
    """A cached forward with the cache as plain tensors in and out: what ``edge.export`` traces.

    Args:
        input_ids, position_ids: [B, n]; attention_mask: [B, T + n] (1: a real key);
        past: per layer (keys, values), each [B, heads, T, d] (T may be 0).

    Returns:
        (logits [B, n, V], last hidden state [B, n, H], then per layer keys and values
        [B, heads, T + n, d]).
    """
    from transformers import DynamicCache

    cache: Any = DynamicCache(config=model.config)
    for layer, (keys, values) in enumerate(past):
        cache.update(keys, values, layer)
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        **cache_arg(model, cache),
        use_cache=True,
        output_hidden_states=True,
    )
    present = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return (out.logits, out.hidden_states[-1], *present)


def _buffer_cache(buffers: list[LayerBuffer]) -> Any:
    """A transformers cache whose layers append into ``buffers`` in place (no cat per step)."""
    from transformers.cache_utils import Cache

    layer = _buffered_layer_class()
    return Cache(layers=[layer(b) for b in buffers])


@functools.cache
def _buffered_layer_class() -> type:
    """transformers' DynamicLayer, appending into a :class:`LayerBuffer` (made once: the class
    needs transformers, which only this module imports, and only when a model is used)."""
    from transformers.cache_utils import DynamicLayer

    class BufferedLayer(DynamicLayer):
        def __init__(self, buffer: LayerBuffer) -> None:
            super().__init__()
            self.buffer = buffer
            self.keys = buffer.keys[:, :, : buffer.filled]
            self.values = buffer.values[:, :, : buffer.filled]
            self.is_initialized = True
            self.device = buffer.keys.device

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            self.keys, self.values = self.buffer.append(key_states, value_states)
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.buffer.filled

    return BufferedLayer


def hidden_size(loaded: LoadedModel) -> int:
    """Width of the model's features (its last hidden state)."""
    return int(loaded.model.get_output_embeddings().weight.shape[1])


def layer_count(loaded: LoadedModel) -> int:
    """L, the decoder's layers: its hidden states are taps 0..L (:func:`starsd.llama.tapped`)."""
    return int(loaded.model.config.num_hidden_layers)


@dataclass(frozen=True)
class TokenizerInfo:
    """What a process that never loads the target (EAGLE hub, emulated targets) needs of it."""

    name: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_positions: int | None


def load_tokenizer_info(path: str | Path) -> TokenizerInfo:
    """Tokenizer fingerprint, vocabulary and position limit of a model directory, no weights."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return TokenizerInfo(
        Path(str(path)).name,
        int(config.vocab_size),
        tokenizer_fingerprint(tokenizer),
        _max_positions(config),
    )


def encode_text(loaded: LoadedModel, text: str) -> list[int]:
    """Token ids of a prompt (with the tokenizer's own special-token convention)."""
    return list(loaded.tokenizer(text)["input_ids"])


def decode_ids(loaded: LoadedModel, ids: list[int]) -> str:
    """Text of generated token ids, special tokens dropped."""
    return str(loaded.tokenizer.decode(ids, skip_special_tokens=True))


def has_chat_template(loaded: LoadedModel) -> bool:
    """Whether the tokenizer carries a chat template (chat requests need one)."""
    return bool(getattr(loaded.tokenizer, "chat_template", None))


def chat_prompt_ids(loaded: LoadedModel, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template, ready for the
    assistant's turn. The template writes its own special tokens (no second BOS is added).
    ValueError when the tokenizer has no template or the template refuses the messages."""
    if not has_chat_template(loaded):
        raise ValueError(f"model {loaded.name} has no chat template")
    try:
        rendered = loaded.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
    except Exception as exc:  # a jinja TemplateError (e.g. raise_exception on a role)
        raise ValueError(f"the chat template refused the messages: {exc}") from None
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    return [int(i) for i in ids]


def default_drafter(pair: str, kind: str | None, model: str | None) -> tuple[str, str]:
    """The hub's (draft kind, model) for ``pair`` given what was asked: neither, the pair's
    default drafter; a model alone, a draft LLM; a kind alone, the pair's model of that kind
    (the kinds without a model, null and emulated, read the draft LLM's tokenizer)."""
    drafters = DRAFTERS[pair]
    kind = kind or (next(iter(drafters)) if model is None else "llm")
    return kind, model or str(drafters.get(kind, PAIRS[pair][1]))
