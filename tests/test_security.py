"""CURVE + ZAP security: handshake-time rejection, per-message identity, revocation, key CLI."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from starsd import cli
from starsd.curve_client import (
    CurveClientConfig,
    HandshakeRejected,
    HandshakeTimeout,
    connect_verified,
    secure_client,
)
from starsd.hub.auth import (
    AllowList,
    CurveServerConfig,
    InsecureEndpointError,
    check_plaintext_endpoint,
    is_loopback,
    peer_address,
    secure_server,
    user_id,
)
from starsd.hub.gate import CurveAuthenticator, start_authenticator
from starsd.keys import KeyFileError, generate_keypair, load_keypair, load_public_key

pytestmark = pytest.mark.timeout(30)

RECV_TIMEOUT_MS = 500  # how long "never reaches the application" is watched for
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Keys:
    """Key pairs for one test: the hub, an allowed target, an unknown target."""

    root: Path
    allow_dir: Path
    hub: Path  # hub.key_secret
    good: Path  # good.key_secret (its .key is in allow_dir)
    bad: Path  # bad.key_secret (not allowed)

    def public(self, secret: Path) -> str:
        return load_keypair(secret).public.decode()

    def client_cfg(self, secret: Path) -> CurveClientConfig:
        return CurveClientConfig(secret, self.root / "hub.key")


@dataclass
class Server:
    """A CURVE ROUTER with a running authenticator on a random loopback port."""

    ctx: zmq.asyncio.Context
    sock: zmq.asyncio.Socket
    endpoint: str
    allow: AllowList
    auth: CurveAuthenticator | None
    clients: list[zmq.asyncio.Socket] = field(default_factory=list)


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    root, allow_dir = tmp_path / "keys", tmp_path / "allow"
    allow_dir.mkdir()
    for name in ("hub", "good", "bad"):
        generate_keypair(root, name)
    shutil.copy(root / "good.key", allow_dir / "good.key")
    return Keys(
        root, allow_dir, root / "hub.key_secret", root / "good.key_secret", root / "bad.key_secret"
    )


async def _start_server(keys: Keys, *, with_auth: bool = True) -> Server:
    ctx = zmq.asyncio.Context()
    allow = AllowList(keys.allow_dir, check_interval_s=0.0)
    auth = start_authenticator(ctx, allow) if with_auth else None
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_server(sock, CurveServerConfig(keys.hub, keys.allow_dir))  # before bind
    sock.bind("tcp://127.0.0.1:0")
    return Server(ctx, sock, sock.getsockopt_string(zmq.LAST_ENDPOINT), allow, auth)


def _stop_server(server: Server) -> None:
    for client in server.clients:
        client.close(linger=0)
    server.sock.close(linger=0)
    if server.auth is not None:
        server.auth.stop()  # before term: the ZAP socket would keep term() waiting
    server.ctx.term()


@pytest.fixture
async def server(keys: Keys) -> AsyncIterator[Server]:
    srv = await _start_server(keys)
    yield srv
    _stop_server(srv)


def _client(server: Server, cfg: CurveClientConfig | None) -> zmq.asyncio.Socket:
    sock = server.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    server.clients.append(sock)
    if cfg is not None:
        secure_client(sock, cfg)  # before connect
    return sock


async def _recv_or_none(
    sock: zmq.asyncio.Socket, timeout_ms: int = RECV_TIMEOUT_MS
) -> list[zmq.Frame] | None:
    if not await sock.poll(timeout_ms):
        return None
    return list(await sock.recv_multipart(copy=False))


async def _try_send(sock: zmq.asyncio.Socket, data: bytes) -> None:
    """Send if the socket takes it (after a failed handshake it may have no pipe at all)."""
    with contextlib.suppress(zmq.Again):
        await sock.send(data, flags=zmq.NOBLOCK)


async def _expect_rejected(sock: zmq.asyncio.Socket, endpoint: str, event: str) -> None:
    started = time.monotonic()
    with pytest.raises(HandshakeRejected) as info:
        await connect_verified(sock, endpoint, timeout_s=1.0)
    assert time.monotonic() - started < 1.0
    assert info.value.event == event


# ---------------------------------------------------------------------------------- handshake


async def test_allowed_client_round_trips_and_is_identified(server: Server, keys: Keys) -> None:
    client = _client(server, keys.client_cfg(keys.good))
    await connect_verified(client, server.endpoint, timeout_s=2.0)
    await client.send(b"ping")
    frames = await _recv_or_none(server.sock, 2000)
    assert frames is not None
    peer, payload = frames
    assert payload.bytes == b"ping"
    assert user_id(payload) == keys.public(keys.good)
    assert user_id(peer) == keys.public(keys.good)  # the routing-id frame carries it too
    assert peer_address(payload) == "127.0.0.1"
    assert server.allow.is_allowed(user_id(payload))
    assert server.allow.name_of(user_id(payload)) == "good"
    await server.sock.send_multipart([peer.bytes, b"pong"])
    assert await asyncio.wait_for(client.recv(), 2.0) == b"pong"


async def test_unknown_key_is_rejected_at_handshake(server: Server, keys: Keys) -> None:
    client = _client(server, keys.client_cfg(keys.bad))
    await _expect_rejected(client, server.endpoint, "HANDSHAKE_FAILED_AUTH")
    await _try_send(client, b"let me in")
    assert await _recv_or_none(server.sock) is None


async def test_plain_text_client_is_rejected(server: Server) -> None:
    client = _client(server, None)
    await _expect_rejected(client, server.endpoint, "HANDSHAKE_FAILED_PROTOCOL")
    await _try_send(client, b"plain")
    assert await _recv_or_none(server.sock) is None


async def test_wrong_hub_public_key_is_rejected(server: Server, keys: Keys) -> None:
    cfg = CurveClientConfig(keys.good, keys.root / "bad.key")  # not the hub's key
    client = _client(server, cfg)
    await _expect_rejected(client, server.endpoint, "HANDSHAKE_FAILED_NO_DETAIL")
    assert await _recv_or_none(server.sock) is None


async def test_server_without_authenticator_fails_closed(keys: Keys) -> None:
    srv = await _start_server(keys, with_auth=False)
    try:
        client = _client(srv, keys.client_cfg(keys.good))  # an allowed key, even
        await _expect_rejected(client, srv.endpoint, "HANDSHAKE_FAILED_NO_DETAIL")
        assert await _recv_or_none(srv.sock) is None
    finally:
        _stop_server(srv)


async def test_handshake_times_out_without_a_hub() -> None:
    # A port nobody listens on. A plain socket closes synchronously; a zmq socket's close is
    # asynchronous, and the client used to complete a handshake with it before it went away.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    ctx = zmq.asyncio.Context()
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    try:
        with pytest.raises(HandshakeTimeout, match=r"retrying|no connection"):
            await connect_verified(client, endpoint, timeout_s=0.5)
    finally:
        client.close(linger=0)
        ctx.term()


async def test_plain_text_mode_has_no_user_id() -> None:
    ctx = zmq.asyncio.Context()
    server = ctx.socket(zmq.ROUTER)
    client = ctx.socket(zmq.DEALER)
    for sock in (server, client):
        sock.setsockopt(zmq.LINGER, 0)
    try:
        server.bind("tcp://127.0.0.1:0")
        await connect_verified(client, server.getsockopt_string(zmq.LAST_ENDPOINT))
        await client.send(b"hi")
        frames = await _recv_or_none(server, 2000)
        assert frames is not None
        assert user_id(frames[1]) is None
    finally:
        client.close(linger=0)
        server.close(linger=0)
        ctx.term()


def test_one_authenticator_per_context(keys: Keys) -> None:
    ctx = zmq.Context()
    allow = AllowList(keys.allow_dir)
    first = start_authenticator(ctx, allow)
    try:
        assert first.running
        with pytest.raises(zmq.ZMQError):
            start_authenticator(ctx, allow)  # the ZAP endpoint is taken
    finally:
        first.stop()
        first.stop()  # idempotent
    assert not first.running
    ctx.term()  # returns: the failed second one left no socket open


# ---------------------------------------------------------------------------------- revocation


async def test_revocation_refuses_open_connection_and_new_handshakes(
    server: Server, keys: Keys
) -> None:
    client = _client(server, keys.client_cfg(keys.good))
    await connect_verified(client, server.endpoint, timeout_s=2.0)
    good = keys.public(keys.good)

    (keys.allow_dir / "good.key").unlink()
    assert server.allow.maybe_reload()  # the directory changed (check interval 0 here)
    assert not server.allow.is_allowed(good)

    # ZAP does not run again on an open connection: the message arrives, with its identity,
    # and the per-message check is what refuses it.
    await client.send(b"after revocation")
    frames = await _recv_or_none(server.sock, 2000)
    assert frames is not None
    assert user_id(frames[1]) == good
    assert not server.allow.is_allowed(user_id(frames[1]))

    again = _client(server, keys.client_cfg(keys.good))
    await _expect_rejected(again, server.endpoint, "HANDSHAKE_FAILED_AUTH")

    shutil.copy(keys.root / "good.key", keys.allow_dir / "good.key")  # re-admit
    assert server.allow.reload()
    readmitted = _client(server, keys.client_cfg(keys.good))
    await connect_verified(readmitted, server.endpoint, timeout_s=2.0)


async def test_handshake_rereads_a_changed_allow_dir(server: Server, keys: Keys) -> None:
    """ZAP itself looks at the directory (rate-limited): no reload call needed for handshakes."""
    (keys.allow_dir / "good.key").unlink()
    client = _client(server, keys.client_cfg(keys.good))
    await _expect_rejected(client, server.endpoint, "HANDSHAKE_FAILED_AUTH")
    shutil.copy(keys.root / "bad.key", keys.allow_dir / "bad.key")
    newcomer = _client(server, keys.client_cfg(keys.bad))
    await connect_verified(newcomer, server.endpoint, timeout_s=2.0)


# ---------------------------------------------------------------------------------- allow-list


def test_allow_list_reload_is_rate_limited_and_tracks_changes(keys: Keys) -> None:
    now = [100.0]
    allow = AllowList(keys.allow_dir, check_interval_s=2.0, clock=lambda: now[0])
    good, bad = keys.public(keys.good), keys.public(keys.bad)
    assert allow.keys == {good}
    assert allow.is_allowed(good.encode())
    assert not allow.is_allowed(None)
    assert not allow.is_allowed(bad)

    shutil.copy(keys.root / "bad.key", keys.allow_dir / "bad.key")
    assert not allow.maybe_reload()  # within the check interval: not even looked at
    now[0] += 2.0
    assert allow.maybe_reload()
    assert allow.is_allowed(bad)
    now[0] += 2.0
    assert not allow.maybe_reload()  # looked, nothing changed


def test_allow_list_skips_bad_files_and_fails_closed(keys: Keys, tmp_path: Path) -> None:
    (keys.allow_dir / "junk.key").write_text("not a certificate\n")
    (keys.allow_dir / "notes.txt").write_text("ignored\n")
    allow = AllowList(keys.allow_dir, check_interval_s=0.0)
    assert allow.keys == {keys.public(keys.good)}

    shutil.rmtree(keys.allow_dir)
    assert allow.maybe_reload()
    assert len(allow) == 0  # gone or unreadable: nobody is allowed

    with pytest.raises(KeyFileError):
        AllowList(tmp_path / "missing")


def test_key_loading_errors_are_clear(keys: Keys, tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="only a public key"):
        load_keypair(keys.root / "good.key")
    with pytest.raises(KeyFileError, match="cannot read"):
        load_keypair(tmp_path / "nope.key_secret")
    with pytest.raises(KeyFileError, match="invalid key name"):
        generate_keypair(tmp_path, "../escape")
    assert load_public_key(keys.good) == load_keypair(keys.good).public


# ---------------------------------------------------------------------------------- endpoints


@pytest.mark.parametrize(
    ("endpoint", "loopback"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.0.0.2:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("ipc:///tmp/starsd.sock", True),
        ("inproc://hub", True),
        ("tcp://*:5555", False),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://[::]:5555", False),
        ("tcp://192.168.1.10:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://hub.example.org:5555", False),
        ("ws://127.0.0.1:5555", False),
        ("127.0.0.1:5555", False),
    ],
)
def test_is_loopback(endpoint: str, loopback: bool) -> None:
    assert is_loopback(endpoint) is loopback


def test_plain_text_refused_off_loopback(caplog: pytest.LogCaptureFixture) -> None:
    check_plaintext_endpoint("tcp://127.0.0.1:5555")
    with pytest.raises(InsecureEndpointError, match="plain text"):
        check_plaintext_endpoint("tcp://*:5555")
    check_plaintext_endpoint("tcp://*:5555", allow_insecure=True)
    assert "plain text" in caplog.text


# ---------------------------------------------------------------------------------- CLI


def test_cli_generate_list_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key_dir = tmp_path / "k"
    assert cli.main(["keys", "generate", "--dir", str(key_dir), "--name", "edge-01"]) == 0
    public, secret = key_dir / "edge-01.key", key_dir / "edge-01.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    assert stat.S_IMODE(key_dir.stat().st_mode) == 0o700
    pair = load_keypair(secret)
    assert load_public_key(public) == pair.public
    assert sorted(p.name for p in key_dir.iterdir()) == ["edge-01.key", "edge-01.key_secret"]
    capsys.readouterr()

    assert cli.main(["keys", "list", "--dir", str(key_dir)]) == 0
    out = capsys.readouterr().out
    assert "edge-01" in out
    assert pair.public.decode() in out
    assert "yes (0600)" in out

    assert cli.main(["keys", "show", str(secret)]) == 0
    out = capsys.readouterr().out
    assert out.strip() == pair.public.decode()
    assert pair.secret.decode() not in out


def test_cli_refuses_to_overwrite_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["keys", "generate", "--dir", str(tmp_path), "--name", "hub"]
    assert cli.main(argv) == 0
    secret = tmp_path / "hub.key_secret"
    before = secret.read_bytes()

    assert cli.main(argv) == 1
    assert "already exist" in capsys.readouterr().err
    assert secret.read_bytes() == before

    assert cli.main([*argv, "--force"]) == 0
    assert secret.read_bytes() != before
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".starsd-keys-")]


def test_cli_runs_as_module(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    gen = [
        sys.executable,
        "-m",
        "starsd.cli",
        "keys",
        "generate",
        "--dir",
        str(tmp_path),
        "--name",
        "t1",
    ]
    done = subprocess.run(gen, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert done.returncode == 0, done.stderr
    listed = subprocess.run(
        [sys.executable, "-m", "starsd.cli", "keys", "list", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    assert "t1" in listed.stdout
