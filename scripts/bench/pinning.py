"""CPU pinning for the benchmarks: confine a process, or this thread for a block, to some CPUs."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def pin(pid: int, cpus: set[int]) -> None:
    """Confine every thread of process ``pid`` to ``cpus`` (threads it starts later inherit the
    mask of the thread that starts them); ``pid`` 0: the calling thread only."""
    if pid == 0:
        os.sched_setaffinity(0, cpus)
        return
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), cpus)


@contextlib.contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """The calling thread confined to ``cpus`` for the block (None: left as it is)."""
    own = os.sched_getaffinity(0)
    try:
        if cpus is not None:
            pin(0, cpus)
        yield
    finally:
        pin(0, own)
