"""Every size limit of the wire and the sockets, in one place: what a message may hold, what a
peer may send or queue, on the hub and on a target. Standard library only (a leaf: the protocol,
the transport and the hub's ROUTER import it).

Messages (:mod:`starsd.protocol` checks them at decode): a header of at most ``MAX_HEADER_BYTES``,
at most ``MAX_FRAMES`` frames, array frames of at most ``MAX_FRAME_BYTES``. Sessions: at most
``MAX_GAMMA`` draft tokens per proposal, ``MAX_APPENDED`` tokens committed per DRAFT,
``MAX_PUSH`` pushed branches per round. Sockets: a frame larger than the socket's limit makes
libzmq drop the connection before the frame is held; the limit is sized to what each side can
legitimately receive (:func:`hub_max_frame_bytes`, :func:`target_max_frame_bytes`), and the
high-water marks bound the complete messages queued per connection.
"""

from __future__ import annotations

# ---------------------------------------------------------------------------------- messages

MAX_HEADER_BYTES = 64 * 1024
MAX_FRAME_BYTES = 16 * 1024 * 1024  # one array frame (a dense [gamma, V] float32 fits easily)
MAX_FRAMES = 8
MAX_ARRAY_ELEMENTS = MAX_FRAME_BYTES
MAX_APPENDED = 1024  # tokens a target may commit between two rounds (one DRAFT)
MAX_GAMMA = 32  # draft tokens in one proposal, whatever a hub announces (Welcome.max_gamma)
MAX_TIMING_US = 600_000_000  # a DRAFT's times (Draft.others_us, forward_us): ten minutes at most
MAX_PUSH = 64  # pushed branches per round a target may ask for (Open.push)
# nodes of one token tree (Proposal.parents): a tree travels like a chain of as many tokens,
# so the frame limits made for MAX_GAMMA dense q rows hold it
MAX_TREE_NODES = MAX_GAMMA

# ---------------------------------------------------------------------------------- sockets

# Any socket without a tighter limit: frames between MAX_FRAME_BYTES and this get a TOO_LARGE
# error reply instead of a dropped connection.
SOCKET_MAX_MSG_BYTES = 4 * MAX_FRAME_BYTES
HWM = 10_000  # messages queued each way on a socket without a tighter bound
TARGET_RCVHWM = 1000  # what one hub may have queued for a target (proposals, branches: a few each)
HUB_RCVHWM = 1000  # complete messages queued per target connection (sessions + a few)
HUB_SNDHWM = 1000  # replies queued per target connection (one proposal in flight per session)
# The hub's frame limit when nothing sizes it: the decoder's own array limit and a header, so a
# frame just over the array limit still gets a TOO_LARGE reply rather than a silent drop.
HUB_MAX_FRAME_BYTES = MAX_FRAME_BYTES + MAX_HEADER_BYTES
_ITEMSIZE = {"float16": 2, "float32": 4}


def hub_max_frame_bytes(
    max_positions: int | None,
    feature_width: int = 0,
    feature_dtype: str = "float16",
    max_gamma: int = 64,
) -> int:
    """The largest frame a hub can legitimately receive.

    A hub receives HELLO, OPEN, DRAFT, CLOSE, PING, PONG, STATS_REQUEST and ERROR: a header
    (``MAX_HEADER_BYTES``), token ids (a prompt or the tokens appended in a round, at most
    ``max(MAX_APPENDED, max_positions)`` int64) and, on an EAGLE hub, features ([rows, width]
    of ``feature_dtype``, rows at most that many again plus ``max_gamma``). Never more than the
    decoder's own limit; with no known context limit, that limit.
    """
    if max_positions is None:
        return HUB_MAX_FRAME_BYTES
    rows = max(MAX_APPENDED, max_positions) + max_gamma
    features = rows * feature_width * _ITEMSIZE[feature_dtype]
    return min(max(MAX_HEADER_BYTES, 8 * rows, features), HUB_MAX_FRAME_BYTES)


def target_max_frame_bytes(vocab_size: int) -> int:
    """The largest frame a target accepts from a hub: a dense q of ``MAX_GAMMA`` rows of
    ``vocab_size`` float32, plus room for a header (a hostile hub cannot make a target buffer
    64 MB frames)."""
    return min(SOCKET_MAX_MSG_BYTES, max(64 * 1024, MAX_GAMMA * vocab_size * 4 + 4096))
