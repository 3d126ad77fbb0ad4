"""CURVE key files: generate, load, list and validate key pairs; used by BOTH sides.

Keys are pyzmq certificate files (``zmq.auth.create_certificates``): ``NAME.key`` holds a public
key, ``NAME.key_secret`` the key pair (mode 0600). The hub has one key pair; each target has its
own; the hub's allow-list (:mod:`starsd.hub.auth`) is a directory of the targets' public ``.key``
files. The ``starsd keys`` command line (:mod:`starsd.cli`) is built on this module, the hub
(:mod:`starsd.hub.auth`) and the targets (:mod:`starsd.curve_client`) load their keys through it.

``zmq.auth.create_certificates`` writes the secret file with the process umask (0644 here, pyzmq
27.3); :func:`generate_keypair` writes it 0600 instead.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

log = logging.getLogger(__name__)

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
SECRET_MODE = 0o600
PUBLIC_MODE = 0o644
Z85_KEY_LEN = 40  # a 32-byte CURVE key in z85
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class KeyFileError(ValueError):
    """A key file is missing, malformed, or of the wrong kind (public vs secret)."""


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair, both halves z85-encoded (40 ASCII bytes each)."""

    public: bytes
    secret: bytes


@dataclass(frozen=True)
class KeyInfo:
    """What ``starsd keys list`` reports for one key name in a directory."""

    name: str
    public_key: str | None
    public_file: Path | None
    secret_file: Path | None
    secret_mode: int | None
    problem: str | None = None


# ---------------------------------------------------------------------------------- key files


def validate_name(name: str) -> str:
    """Return ``name`` if it is a safe key name (letters, digits, ``._-``; no path parts)."""
    if not _NAME_RE.fullmatch(name):
        raise KeyFileError(
            f"invalid key name {name!r}: use letters, digits, '.', '_' or '-' "
            "(starting with a letter or digit, at most 100 characters)"
        )
    return name


def key_paths(directory: Path, name: str) -> tuple[Path, Path]:
    """``(public, secret)`` file paths for key ``name`` in ``directory``."""
    validate_name(name)
    return directory / f"{name}{PUBLIC_SUFFIX}", directory / f"{name}{SECRET_SUFFIX}"


def generate_keypair(directory: Path, name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Write ``NAME.key`` (0644) and ``NAME.key_secret`` (0600) into ``directory``.

    The pair is made by ``zmq.auth.create_certificates`` inside a private (0700) temporary
    directory next to the destination, given its final modes there, then linked into place: the
    secret is never readable by others, and without ``force`` an existing file is never
    replaced (``FileExistsError``), even by a concurrent writer.
    """
    public_dst, secret_dst = key_paths(directory, name)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not force:
        existing = [p for p in (public_dst, secret_dst) if p.exists()]
        if existing:
            verb = "exists" if len(existing) == 1 else "exist"
            names = " and ".join(map(str, existing))
            raise FileExistsError(f"{names} already {verb}; use --force to replace")
    with tempfile.TemporaryDirectory(prefix=".starsd-keys-", dir=directory) as tmp:
        public_src, secret_src = (Path(p) for p in zmq.auth.create_certificates(tmp, name))
        os.chmod(secret_src, SECRET_MODE)
        os.chmod(public_src, PUBLIC_MODE)
        _install(secret_src, secret_dst, force=force)
        try:
            _install(public_src, public_dst, force=force)
        except FileExistsError:
            secret_dst.unlink()  # lost a race on the public half: leave no orphan secret
            raise
    return public_dst, secret_dst


def _install(src: Path, dst: Path, *, force: bool) -> None:
    if force:
        os.replace(src, dst)
    else:
        os.link(src, dst)  # atomic, and fails if dst exists


def load_keypair(path: Path) -> KeyPair:
    """Load a secret certificate (``NAME.key_secret``); checks both halves belong together."""
    public, secret = load_certificate(path)
    if secret is None:
        raise KeyFileError(
            f"{path} holds only a public key; pass the secret file (NAME{SECRET_SUFFIX})"
        )
    _check_z85_key(path, secret)
    if zmq.curve_public(secret) != public:
        raise KeyFileError(f"{path}: public and secret key do not belong together")
    _warn_if_exposed(path)
    return KeyPair(public=public, secret=secret)


def load_public_key(path: Path, *, warn_if_secret: bool = True) -> bytes:
    """Load the z85 public key from a certificate file (a public or a secret one).

    A file that also holds a secret key is logged as a warning (it was handed to the wrong
    side) unless ``warn_if_secret`` is False.
    """
    public, secret = load_certificate(path)
    if secret is not None and warn_if_secret:
        log.warning(
            "%s contains a SECRET key; only its public half is used here. Give this "
            "side the public file (NAME%s) instead.",
            path,
            PUBLIC_SUFFIX,
        )
    return public


def load_certificate(path: Path) -> tuple[bytes, bytes | None]:
    """``(public, secret or None)`` z85 keys of a certificate file; KeyFileError if unusable."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc}") from exc
    except ValueError as exc:
        raise KeyFileError(f"{path} is not a ZeroMQ certificate: {exc}") from exc
    _check_z85_key(path, public)
    return public, secret


def _check_z85_key(path: Path, key: bytes) -> None:
    try:
        ok = len(key) == Z85_KEY_LEN and len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise KeyFileError(f"{path}: not a valid z85 CURVE key ({len(key)} characters)")


def _warn_if_exposed(path: Path) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        log.warning(
            "secret key file %s has mode %04o: others may read it (chmod 600 %s)", path, mode, path
        )


def list_keys(directory: Path) -> list[KeyInfo]:
    """Every key name in ``directory`` with its public key and whether a secret file exists."""
    suffixes = (PUBLIC_SUFFIX, SECRET_SUFFIX)
    names = sorted(
        {
            p.name.removesuffix(SECRET_SUFFIX).removesuffix(PUBLIC_SUFFIX)
            for p in directory.iterdir()
            if p.is_file() and p.name.endswith(suffixes)
        }
    )
    return [_key_info(directory, name) for name in names]


def _key_info(directory: Path, name: str) -> KeyInfo:
    public_file = directory / f"{name}{PUBLIC_SUFFIX}"
    secret_file = directory / f"{name}{SECRET_SUFFIX}"
    pub_path = public_file if public_file.is_file() else None
    sec_path = secret_file if secret_file.is_file() else None
    mode = stat.S_IMODE(sec_path.stat().st_mode) if sec_path else None
    public_key: str | None = None
    problem: str | None = None
    try:
        keys = [load_certificate(p)[0] for p in (pub_path, sec_path) if p is not None]
        public_key = keys[0].decode("ascii")
        if len(set(keys)) > 1:
            problem = "public and secret files hold different keys"
    except KeyFileError as exc:
        problem = str(exc)
    if problem is None and mode is not None and mode & 0o077:
        problem = f"secret file mode {mode:04o} is readable by others"
    return KeyInfo(name, public_key, pub_path, sec_path, mode, problem)
