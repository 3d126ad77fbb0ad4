"""Encode and decode speed of ``starsd.protocol``, alone or side by side with an older copy.

    python -m scripts.bench.protocol_speed                              # current figures
    python -m scripts.bench.protocol_speed --old /tmp/protocol_old.py   # old vs new, with ratios

CPU speed on shared VMs drifts within minutes, so old and new are timed in short alternating
blocks (old new new old old new ...), in process CPU time, and each figure is the median over
the blocks of one run; compare only figures printed by the same run.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from starsd import protocol

TAG = bytes(range(16))


def load(path: str) -> ModuleType:
    """Import a protocol.py by file path, as its own module (``protocol_old``)."""
    spec = importlib.util.spec_from_file_location("protocol_old", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolves string annotations (ClassVar) through sys.modules
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def samples(p: Any) -> dict[str, Any]:
    """Representative messages, built from module ``p``'s own classes."""
    rng = np.random.default_rng(0)
    tokens = np.arange(4, dtype=np.int32)
    dense = rng.random((4, 2048), dtype=np.float32)
    sampling = p.SamplingParams(0.7, 50, 0.9, 42)
    return {
        "DRAFT 4 tokens": p.Draft(TAG, 7, 3, tokens),
        "PROPOSAL greedy 4": p.Proposal(TAG, 7, tokens, epoch=b"\x01" * 8),
        "PROPOSAL dense q 4x2048": p.Proposal(TAG, 7, tokens, dense, epoch=b"\x01" * 8),
        "OPEN 32-token prompt": p.Open(3, np.arange(32, dtype=np.int32), sampling, 4),
        "HELLO": p.Hello("target-7b", 32000, "abc123", feature_width=4096),
        "STATS": p.Stats(3, 1.5, 0.5, 10, 4, 2, 1, 9, 36, 20, 0.01, b"\x01" * 8),
    }


def jobs(p: Any) -> dict[tuple[str, str], Callable[[], object]]:
    """(message, "encode" | "decode") -> a no-argument call timing that operation."""
    out: dict[tuple[str, str], Callable[[], object]] = {}
    for name, msg in samples(p).items():
        frames = [bytes(f) for f in p.encode(msg)]  # as received: plain bytes per frame
        out[name, "encode"] = functools.partial(p.encode, msg)
        out[name, "decode"] = functools.partial(p.decode, frames)
    return out


def per_call_us(fn: Callable[[], object], number: int) -> float:
    """CPU microseconds per call over one block of ``number`` calls (CPU time, not wall time:
    on a shared machine, time spent descheduled would otherwise land in random blocks)."""
    return timeit.Timer(fn, timer=time.process_time).timeit(number) / number * 1e6


def measure(modules: list[Any], repeats: int) -> dict[tuple[str, str], list[float]]:
    """Median microseconds per (message, operation) for each module, in alternating blocks."""
    tables = [jobs(m) for m in modules]
    # ~2 ms blocks; every repeat visits every row, so slow stretches hit all rows alike
    numbers = {k: max(1, timeit.Timer(fn).autorange()[0] // 100) for k, fn in tables[0].items()}
    times: dict[tuple[str, str], list[list[float]]] = {k: [[] for _ in modules] for k in numbers}
    for r in range(repeats):
        order = list(range(len(modules)))[:: 1 if r % 2 == 0 else -1]  # ABBA: drift cancels
        for key, number in numbers.items():
            for i in order:
                times[key][i].append(per_call_us(tables[i][key], number))
    return {key: [statistics.median(t) for t in ts] for key, ts in times.items()}


def main() -> None:
    """Print the table: one row per message and operation."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", help="path of an older protocol.py to compare against")
    parser.add_argument("--repeats", type=int, default=61, help="blocks per implementation")
    args = parser.parse_args()
    modules = [load(args.old), protocol] if args.old else [protocol]
    result = measure(modules, args.repeats)
    labels = ["old us", "new us", "new/old"] if args.old else ["us"]
    head = "".join(f"{label:>8} " for label in labels)
    print(f"{'message':<26}{'op':<8}{head}")
    for (name, op), medians in result.items():
        cells = "".join(f"{m:8.2f} " for m in medians)
        ratio = f"{medians[1] / medians[0]:8.2f}" if args.old else ""
        print(f"{name:<26}{op:<8}{cells}{ratio}")


if __name__ == "__main__":
    main()
