"""The ``starsd`` command: key management for CURVE-secured hubs and targets, cost profiles
and fleet planning.

    starsd keys generate --dir DIR --name NAME [--force]   write NAME.key + NAME.key_secret (0600)
    starsd keys list --dir DIR                            names, public keys, secret present?
    starsd keys show PATH                                 the public key in a .key/.key_secret file

Also ``python -m starsd.cli keys ...``. The hub gets ``--curve-secret hub.key_secret --allow-dir
DIR`` (DIR holding the targets' ``.key`` files); a target gets ``--curve-secret NAME.key_secret
--hub-public-key hub.key``. See SECURITY.md.

    starsd profile draft|target|link|check ...            measure costs into a profile JSON
    starsd plan --draft D.json --target T.json[:COUNT]    throughput against N, hubs needed

(:mod:`starsd.profile_cli`; docs/planning.md.)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from starsd import profile_cli
from starsd.keys import Z85_KEY_LEN, KeyFileError, generate_keypair, list_keys, load_public_key


@dataclass(frozen=True)
class KeysGenerate:
    """``starsd keys generate``."""

    directory: Path
    name: str
    force: bool = False


@dataclass(frozen=True)
class KeysList:
    """``starsd keys list``."""

    directory: Path


@dataclass(frozen=True)
class KeysShow:
    """``starsd keys show``."""

    path: Path


@dataclass(frozen=True)
class Profiling:
    """``starsd profile ...`` and ``starsd plan``: their parsed arguments."""

    args: argparse.Namespace


Command = KeysGenerate | KeysList | KeysShow | Profiling


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree for ``starsd``."""
    parser = argparse.ArgumentParser(prog="starsd", description="StarSD utilities.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    keys = commands.add_parser("keys", help="CURVE key pairs for the hub and its targets")
    actions = keys.add_subparsers(dest="action", required=True, metavar="ACTION")

    gen = actions.add_parser("generate", help="write NAME.key and NAME.key_secret into DIR")
    gen.add_argument("--dir", required=True, type=Path, help="key directory (created 0700)")
    gen.add_argument("--name", required=True, help="key name, e.g. hub or edge-01")
    gen.add_argument("--force", action="store_true", help="replace an existing key pair")

    lst = actions.add_parser("list", help="list the keys in DIR")
    lst.add_argument("--dir", required=True, type=Path, help="key directory")

    show = actions.add_parser("show", help="print the public key of a key file (never a secret)")
    show.add_argument("path", type=Path, help="a NAME.key or NAME.key_secret file")
    profile_cli.add_parsers(commands)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> Command:
    """argv -> one frozen command object."""
    ns = build_parser().parse_args(argv)
    if ns.command in ("profile", "plan"):
        return Profiling(ns)
    if ns.action == "generate":
        return KeysGenerate(directory=ns.dir, name=ns.name, force=ns.force)
    if ns.action == "list":
        return KeysList(directory=ns.dir)
    return KeysShow(path=ns.path)


def run(cmd: Command) -> int:
    """Execute a parsed command; returns the exit status (0 ok, 1 refused or failed, 2 a bad
    profile or plan input)."""
    try:
        match cmd:
            case KeysGenerate():
                return _generate(cmd)
            case KeysList():
                return _list(cmd)
            case KeysShow():
                return _show(cmd)
            case Profiling():
                return profile_cli.run(cmd.args)
    except (KeyFileError, FileExistsError, OSError) as exc:
        print(f"starsd: error: {exc}", file=sys.stderr)
        return 1
    raise AssertionError(f"unhandled command {cmd!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``starsd``."""
    return run(parse_args(argv))


def _generate(cmd: KeysGenerate) -> int:
    public_file, secret_file = generate_keypair(cmd.directory, cmd.name, force=cmd.force)
    public = load_public_key(public_file).decode("ascii")
    print(f"public key  {public_file}  {public}")
    print(f"secret key  {secret_file}  (mode 0600: keep it on this machine only)")
    print(
        f"next: copy {public_file.name} to the peers that must recognise '{cmd.name}' (a "
        "target's .key into the hub's --allow-dir; the hub's .key to every target)"
    )
    return 0


def _list(cmd: KeysList) -> int:
    if not cmd.directory.is_dir():
        print(f"starsd: error: {cmd.directory} is not a directory", file=sys.stderr)
        return 1
    infos = list_keys(cmd.directory)
    if not infos:
        print(f"no keys in {cmd.directory}")
        return 0
    width = max(len(i.name) for i in infos)
    print(f"{'NAME':<{width}}  {'PUBLIC KEY (z85)':<{Z85_KEY_LEN}}  SECRET")
    for info in infos:
        public = info.public_key or "?"
        secret = "no" if info.secret_file is None else f"yes ({info.secret_mode or 0:04o})"
        line = f"{info.name:<{width}}  {public:<{Z85_KEY_LEN}}  {secret}"
        print(line + (f"  !! {info.problem}" if info.problem else ""))
    return 0


def _show(cmd: KeysShow) -> int:
    public = load_public_key(cmd.path, warn_if_secret=False).decode("ascii")
    print(public)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
