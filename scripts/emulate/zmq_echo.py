"""A bare ZeroMQ echo service: the hub's socket and reader loop, no protocol and no threads.

    python -m scripts.emulate.zmq_echo --bind tcp://127.0.0.1:*

The benchmarks measure the hub's per-round overhead against this process's round trip, so both
sides of the comparison cross the same process boundary on the same event loop.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass

from starsd import transport
from starsd.hub.router import Received, bind_router


@dataclass(frozen=True)
class EchoConfig:
    """What scripts/emulate/zmq_echo.py is told."""

    bind: str = "tcp://127.0.0.1:*"


async def serve(cfg: EchoConfig) -> None:
    """Reflect every message to its sender until cancelled."""
    ctx = transport.new_context()
    router = bind_router(ctx, cfg.bind)
    print(f"echo listening on {router.endpoint}", flush=True)

    def echo(batch: list[Received]) -> None:
        for received in batch:
            router.send_frames(received.peer, received.frames)

    router.start(echo)
    try:
        await asyncio.Event().wait()  # until cancelled
    except asyncio.CancelledError:
        pass
    finally:
        router.close()
        ctx.term()


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bind", default=EchoConfig.bind)
    transport.run_loop(serve(EchoConfig(**vars(p.parse_args(argv)))))


if __name__ == "__main__":
    main()
