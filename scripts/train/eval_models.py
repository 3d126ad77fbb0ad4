"""Re-measure StarSD's default model pair and write ``results/eval-models.json``.

Figures: teacher-forced top-1 agreement of the draft with the target on held-out plays, held-out
loss of both models, distinct-4-gram share of the target's greedy text, accepted tokens per round
of greedy speculative decoding, the target/draft cost of one KV-cached decode step, and the
wall-clock speedup of in-process greedy speculative decoding over the target alone (with a token
for token equality check), plus sample texts. Timed things are measured alternately (A B A B) on
one torch thread and reported as ratios.

Run from the repository root::

    .venv/bin/python -m scripts.train.eval_models
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from scripts.train.config_args import parse_config
from scripts.train.shakespeare_corpus import DEFAULT_CACHE_DIR, load_corpus

SAMPLE_PROMPTS: tuple[str, ...] = (
    "Ham.\nTo be, or not to be,",
    "ACT I.\n\nScene I. A room in the palace.\n\n[Enter the King and Queen.]\n\nKing.\n",
    "Rom.\nBut soft! what light",
    "First Citizen.\n",
)
T = TypeVar("T")
REQUIRED = {"agreement": 0.70, "cost_ratio": 4.0, "speedup": 1.8}


@dataclass(frozen=True)
class EvalConfig:
    """Every knob of the evaluation."""

    target_dir: Path = Path("models/starsd-target")
    draft_dir: Path = Path("models/starsd-draft")
    cache_dir: Path = DEFAULT_CACHE_DIR
    out_path: Path = Path("results/eval-models.json")
    gamma: int = 4
    sweep_gammas: str = "2,3,4,5,6"
    new_tokens: int = 96
    num_prompts: int = 8
    prompt_tokens: int = 32
    agreement_windows: int = 256
    window: int = 128
    cost_repeats: int = 9
    cost_steps: int = 32
    speed_passes: int = 2
    sample_tokens: int = 80
    threads: int = 1


def parse_args(argv: list[str] | None = None) -> EvalConfig:
    """Build a EvalConfig from the command line; every field has a flag of the same name."""
    return parse_config(EvalConfig, __doc__, argv)


def load_model(directory: Path) -> PreTrainedModel:
    """Load a model in float32 for exact, comparable CPU measurements."""
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def heldout_stream(config: EvalConfig, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Held-out works encoded without specials and joined with EOS."""
    return encode_works(tokenizer, [text for _, text in load_corpus(config.cache_dir).heldout])


def encode_works(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[int]:
    """Works encoded without specials, each followed by EOS, as one id stream."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids)
        ids.append(tokenizer.eos_token_id)
    return ids


def evenly_spaced(stream: list[int], count: int, length: int) -> list[list[int]]:
    """``count`` non-overlapping slices of ``length`` tokens spread evenly over the stream."""
    usable = len(stream) // length
    picks = [round(i * (usable - 1) / max(1, count - 1)) for i in range(min(count, usable))]
    return [stream[p * length : (p + 1) * length] for p in sorted(set(picks))]


@torch.inference_mode()
def teacher_forced(
    target: PreTrainedModel, draft: PreTrainedModel, windows: list[list[int]], bos: int
) -> dict[str, float]:
    """Top-1 agreement of draft with target, each model's accuracy and loss, on BOS+window."""
    agree = target_hits = draft_hits = total = 0
    target_loss = draft_loss = 0.0
    for start in range(0, len(windows), 16):
        ids = torch.tensor([[bos, *w] for w in windows[start : start + 16]])
        labels = ids[:, 1:]
        t_logits = target(input_ids=ids).logits[:, :-1]
        d_logits = draft(input_ids=ids).logits[:, :-1]
        t_top, d_top = t_logits.argmax(-1), d_logits.argmax(-1)
        agree += int((t_top == d_top).sum())
        target_hits += int((t_top == labels).sum())
        draft_hits += int((d_top == labels).sum())
        total += labels.numel()
        target_loss += float(
            F.cross_entropy(t_logits.flatten(0, 1), labels.flatten(), reduction="sum")
        )
        draft_loss += float(
            F.cross_entropy(d_logits.flatten(0, 1), labels.flatten(), reduction="sum")
        )
    return {
        "agreement": round(agree / total, 4),
        "target_accuracy": round(target_hits / total, 4),
        "draft_accuracy": round(draft_hits / total, 4),
        "target_loss": round(target_loss / total, 4),
        "draft_loss": round(draft_loss / total, 4),
        "positions": total,
    }


def next_token(model: PreTrainedModel, ids: list[int], cache: DynamicCache) -> int:
    """Feed ``ids`` through ``model`` with its cache and return the greedy next token."""
    logits = model(input_ids=torch.tensor([ids]), cache=cache, logits_to_keep=1).logits
    return int(logits[0, -1].argmax())


@torch.inference_mode()
def target_greedy(target: PreTrainedModel, prompt: list[int], new_tokens: int) -> list[int]:
    """Plain greedy decoding with a KV cache: one target forward per token."""
    cache = DynamicCache(config=target.config)
    token = next_token(target, prompt, cache)
    out = [token]
    while len(out) < new_tokens:
        token = next_token(target, [token], cache)
        out.append(token)
    return out


@torch.inference_mode()
def speculative_greedy(
    target: PreTrainedModel, draft: PreTrainedModel, prompt: list[int], new_tokens: int, gamma: int
) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding; returns the new tokens and accepted draft tokens per round.

    Invariant at the top of each round: the target cache holds every committed token but the
    last (``token``); the draft cache holds every committed token but those in ``pending``.
    """
    t_cache, d_cache = DynamicCache(config=target.config), DynamicCache(config=draft.config)
    token = next_token(target, prompt, t_cache)
    draft(input_ids=torch.tensor([prompt]), cache=d_cache, logits_to_keep=1)
    out, accepted, pending = [token], [], [token]
    while len(out) < new_tokens:
        proposal: list[int] = []
        for _ in range(gamma):
            proposal.append(next_token(draft, pending, d_cache))
            pending = proposal[-1:]
        logits = target(input_ids=torch.tensor([[token, *proposal]]), cache=t_cache).logits
        choices = logits[0].argmax(-1).tolist()
        n = 0
        while n < gamma and proposal[n] == choices[n]:
            n += 1
        token = choices[n]
        out.extend([*proposal[:n], token])
        accepted.append(n)
        t_cache.crop(-(gamma - n))  # crop(-0) is a no-op: nothing rejected
        if n == gamma:
            pending = [proposal[-1], token]
        else:
            d_cache.crop(-(gamma - 1 - n))
            pending = [token]
    return out[:new_tokens], accepted


def distinct_4gram_share(tokens: list[int]) -> float:
    """Distinct 4-grams divided by all 4-grams of one sequence."""
    grams = [tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / max(1, len(grams))


def acceptance_summary(accepted: list[int], gamma: int) -> dict[str, float]:
    """Mean accepted draft tokens per round, tokens per target pass, per-token accept rate."""
    mean = sum(accepted) / max(1, len(accepted))
    return {
        "gamma": gamma,
        "rounds": len(accepted),
        "mean_accepted_per_round": round(mean, 3),
        "tokens_per_target_pass": round(mean + 1, 3),
        "draft_token_accept_rate": round(mean / gamma, 3),
    }


def timed(function: Callable[[], T]) -> tuple[float, T]:
    """Wall seconds of one call, and its result."""
    start = time.perf_counter()
    value = function()
    return time.perf_counter() - start, value


@torch.inference_mode()
def decode_steps(model: PreTrainedModel, context: list[int], steps: list[int]) -> float:
    """Seconds for ``len(steps)`` single-token KV-cached forwards after prefilling ``context``."""
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([context]), cache=cache, logits_to_keep=1)
    start = time.perf_counter()
    for token in steps:
        model(input_ids=torch.tensor([[token]]), cache=cache, logits_to_keep=1)
    return time.perf_counter() - start


@torch.inference_mode()
def verify_cost(
    model: PreTrainedModel, context: list[int], block: list[int], repeats: int
) -> float:
    """Cost of one forward over ``block`` in single-token decode steps, measured alternately.

    Both are run on the same prefilled cache, which is cropped back after each forward.
    """
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([context]), cache=cache, logits_to_keep=1)
    ratios = []
    for _ in range(repeats):
        seconds = []
        for ids in (block[:1], block):
            start = time.perf_counter()
            model(input_ids=torch.tensor([ids]), cache=cache)
            seconds.append(time.perf_counter() - start)
            cache.crop(-len(ids))
        ratios.append(seconds[1] / seconds[0])
    return statistics.median(ratios)


def cost_ratio(
    target: PreTrainedModel, draft: PreTrainedModel, stream: list[int], config: EvalConfig
) -> dict[str, float]:
    """Target/draft cost per decode step, measured alternately; median of per-pair ratios."""
    context, steps = stream[:64], stream[64 : 64 + config.cost_steps]
    decode_steps(target, context, steps), decode_steps(draft, context, steps)  # warm-up
    ratios, t_ms, d_ms = [], [], []
    for _ in range(config.cost_repeats):
        t = decode_steps(target, context, steps)
        d = decode_steps(draft, context, steps)
        ratios.append(t / d)
        t_ms.append(1000 * t / len(steps))
        d_ms.append(1000 * d / len(steps))
    block = stream[64 : 64 + config.gamma + 1]
    return {
        "cost_ratio_median": round(statistics.median(ratios), 3),
        "cost_ratio_min": round(min(ratios), 3),
        "cost_ratio_max": round(max(ratios), 3),
        "target_step_ms": round(statistics.median(t_ms), 3),
        "draft_step_ms": round(statistics.median(d_ms), 3),
        "target_verify_cost_in_steps": round(verify_cost(target, context, block, 31), 3),
    }


def speed_comparison(
    target: PreTrainedModel, draft: PreTrainedModel, prompts: list[list[int]], config: EvalConfig
) -> tuple[dict[str, object], list[list[int]], list[int]]:
    """Alternate target-alone and speculative greedy decoding on the same prompts.

    Returns the figures, the target's greedy outputs and every round's accepted count (last pass).
    """
    n, gamma = config.new_tokens, config.gamma
    target_greedy(target, prompts[0], 8), speculative_greedy(target, draft, prompts[0], 8, gamma)
    target_total = spec_total = 0.0
    identical = True
    greedy_outputs: list[list[int]] = []
    accepted_all: list[int] = []
    for pass_index in range(config.speed_passes):
        greedy_outputs, accepted_all = [], []
        for index, prompt in enumerate(prompts):
            alone = functools.partial(target_greedy, target, prompt, n)
            spec = functools.partial(speculative_greedy, target, draft, prompt, n, gamma)
            if (pass_index + index) % 2:
                spec_seconds, (spec_tokens, accepted) = timed(spec)
                target_seconds, tokens = timed(alone)
            else:
                target_seconds, tokens = timed(alone)
                spec_seconds, (spec_tokens, accepted) = timed(spec)
            target_total += target_seconds
            spec_total += spec_seconds
            identical &= spec_tokens == tokens
            greedy_outputs.append(tokens)
            accepted_all.extend(accepted)
    figures = {
        "prompts": len(prompts),
        "new_tokens": n,
        "passes": config.speed_passes,
        "target_alone_seconds": round(target_total, 3),
        "speculative_seconds": round(spec_total, 3),
        "speedup": round(target_total / spec_total, 3),
        "target_alone_tokens_per_second": round(
            n * len(prompts) * config.speed_passes / target_total, 1
        ),
        "speculative_tokens_per_second": round(
            n * len(prompts) * config.speed_passes / spec_total, 1
        ),
        "identical_to_target_greedy": identical,
    }
    return figures, greedy_outputs, accepted_all


def gamma_sweep(
    target: PreTrainedModel, draft: PreTrainedModel, prompts: list[list[int]], config: EvalConfig
) -> list[dict[str, float]]:
    """Acceptance (not time) of speculative decoding at several gammas."""
    rows = []
    for gamma in (int(g) for g in config.sweep_gammas.split(",") if g):
        accepted: list[int] = []
        for prompt in prompts:
            accepted.extend(speculative_greedy(target, draft, prompt, config.new_tokens, gamma)[1])
        rows.append(acceptance_summary(accepted, gamma))
    return rows


def samples(
    target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: EvalConfig
) -> list[dict[str, str]]:
    """Greedy target continuations of Shakespeare-like prompts."""
    rows = []
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer.encode(prompt)
        text = tokenizer.decode(target_greedy(target, ids, config.sample_tokens))
        rows.append({"prompt": prompt, "completion": text})
    return rows


def parameter_count(model: PreTrainedModel) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def pair_files(config: EvalConfig) -> dict[str, object]:
    """Bytes on disk of each model directory (model cards excluded) and tokenizer identity."""
    sizes = {}
    for name, directory in (("target", config.target_dir), ("draft", config.draft_dir)):
        files = [p for p in directory.iterdir() if p.is_file() and p.name != "README.md"]
        sizes[name] = sum(p.stat().st_size for p in files)
    same = all(
        (config.target_dir / name).read_bytes() == (config.draft_dir / name).read_bytes()
        for name in ("tokenizer.json", "tokenizer_config.json")
    )
    return {
        "target_bytes": sizes["target"],
        "draft_bytes": sizes["draft"],
        "pair_bytes": sizes["target"] + sizes["draft"],
        "identical_tokenizer_files": same,
    }


def main(argv: list[str] | None = None) -> None:
    """Measure the pair, write the JSON report and print it."""
    config = parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(config.threads)
    tokenizer = AutoTokenizer.from_pretrained(config.target_dir)
    target, draft = load_model(config.target_dir), load_model(config.draft_dir)
    stream = heldout_stream(config, tokenizer)
    bos = tokenizer.bos_token_id
    windows = evenly_spaced(stream, config.agreement_windows, config.window - 1)
    prompts = [[bos, *p] for p in evenly_spaced(stream, config.num_prompts, config.prompt_tokens)]

    quality = teacher_forced(target, draft, windows, bos)
    cost = cost_ratio(target, draft, stream, config)
    speed, greedy_outputs, accepted = speed_comparison(target, draft, prompts, config)
    distinct = [distinct_4gram_share(tokens) for tokens in greedy_outputs]
    files = pair_files(config)
    report = {
        "config": asdict(config),
        "parameters": {"target": parameter_count(target), "draft": parameter_count(draft)},
        "files": files,
        "heldout_teacher_forced": quality,
        "target_greedy_distinct_4gram_share": round(statistics.mean(distinct), 4),
        "speculative_acceptance": acceptance_summary(accepted, config.gamma),
        "acceptance_by_gamma": gamma_sweep(target, draft, prompts, config),
        "cost": cost,
        "speed": speed,
        "samples": samples(target, tokenizer, config),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    report["requirements"] = {
        "agreement>=0.70": quality["agreement"] >= REQUIRED["agreement"],
        "cost_ratio>=4": cost["cost_ratio_median"] >= REQUIRED["cost_ratio"],
        "speedup>=1.8": speed["speedup"] >= REQUIRED["speedup"],
        "identical_to_target_greedy": speed["identical_to_target_greedy"],
        "pair<=10MB": files["pair_bytes"] <= 10_000_000,
        "identical_tokenizer_files": files["identical_tokenizer_files"],
    }
    config.out_path.parent.mkdir(parents=True, exist_ok=True)
    config.out_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
