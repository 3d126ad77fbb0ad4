"""Tiny random-weight model pairs built from a config and saved like any transformers directory.

The draft copies the target's embedding, final norm and first layer, so it agrees with the target
part of the time: tests then see accepted, rejected and bonus tokens in the same run.
"""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = (
    "To be, or not to be, that is the question: whether tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles. "
    "Now is the winter of our discontent made glorious summer by this sun of York. "
    "All the world's a stage, and all the men and women merely players. "
) * 4


def build_tokenizer(vocab_size: int = 320, extra: str = "") -> object:
    """A small byte-level BPE wrapped as a transformers fast tokenizer (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS + extra], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")


def _llama(vocab: int, layers: int, eos: int) -> object:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    return LlamaForCausalLM(config)


def _gpt2(vocab: int, layers: int, eos: int) -> object:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab,
        n_embd=64,
        n_layer=layers,
        n_head=4,
        n_positions=256,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    return GPT2LMHeadModel(config)


def _quieten_upper_layers(model: object, scale: float) -> None:
    # Shrink what layers >= 1 add to the residual stream, so a draft made of layer 0 alone
    # agrees with the target often but not always.
    with torch.no_grad():
        for name, param in model.named_parameters():  # type: ignore[attr-defined]
            upper = ".0." not in name and (".layers." in name or ".h." in name)
            if upper and name.endswith(("o_proj.weight", "down_proj.weight", "c_proj.weight")):
                param.mul_(scale)


def build_pair(
    root: Path,
    family: str = "llama",
    seed: int = 0,
    tokenizer: object | None = None,
    scale: float = 0.3,
) -> tuple[Path, Path]:
    """Save a target (3 layers) and a draft (its first layer) under ``root``; returns the dirs."""
    torch.manual_seed(seed)
    tok = tokenizer or build_tokenizer()
    vocab = len(tok)  # type: ignore[arg-type]
    eos = tok.eos_token_id  # type: ignore[attr-defined]
    make = {"llama": _llama, "gpt2": _gpt2}[family]
    target = make(vocab, 3, eos)
    _quieten_upper_layers(target, scale)
    draft = make(vocab, 1, eos)
    own = draft.state_dict()  # type: ignore[attr-defined]
    own.update({k: v for k, v in target.state_dict().items() if k in own})  # type: ignore[attr-defined]
    draft.load_state_dict(own)  # type: ignore[attr-defined]
    dirs = []
    for name, model in (("target", target), ("draft", draft)):
        path = root / f"{family}-{name}"
        model.save_pretrained(path)  # type: ignore[attr-defined]
        tok.save_pretrained(path)  # type: ignore[attr-defined]
        dirs.append(path)
    return dirs[0], dirs[1]
