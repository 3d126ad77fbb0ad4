"""Cost profiles: what ``starsd profile`` writes and ``starsd plan`` reads. Pure (no torch).

A profile is one JSON file per model and machine, one of three kinds:

* ``draft``: S(B, g), the hub's proposal cost for B sessions drafting g tokens each
  (``grid.service_ms``: one cell per (batch, gamma));
* ``target``: T(B), one forward of one position per row (``grid.step_ms``: one cell per batch),
  and V(B, g), one forward of g + 1 positions per row (``grid.verify_ms``), both after a cached
  context;
* ``link``: the round trip to a hub (``grid.round_trip_ms``: one cell; ``grid.connect_ms``).

Every cell holds ``median_ms`` and, when measured, ``p10_ms``, ``p90_ms`` and ``n`` (repeats).
Besides the grid: ``schema`` ("starsd-profile"), ``schema_version``, ``protocol_version`` (the
wire protocol of the code that measured), ``kind``, ``source`` ("measured" or "published"),
``machine`` (cpu, cores, torch, device, device name, dtype), ``model`` (its name and
fingerprint, see :func:`model_fingerprint`) and free ``notes`` / ``citations``.

:func:`load_profile` refuses a file it cannot trust with a :class:`ProfileError` whose message
names the file and the field: another schema or protocol version, a missing field, a time that
is negative, zero, NaN or infinite, a grid with holes (a batch without every gamma).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from starsd.protocol import PROTOCOL_VERSION

SCHEMA = "starsd-profile"
SCHEMA_VERSION = 1
KINDS = ("draft", "target", "link")
SOURCES = ("measured", "published")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".onnx")
# The grid fields of each kind: (field, whether its cells are per gamma).
GRIDS: dict[str, tuple[tuple[str, bool], ...]] = {
    "draft": (("service_ms", True),),
    "target": (("step_ms", False), ("verify_ms", True)),
    "link": (("round_trip_ms", False),),
}


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Profile:
    """A validated profile: its file, kind, source and raw JSON."""

    path: str
    kind: str
    source: str
    raw: dict[str, Any]

    @property
    def name(self) -> str:
        """The model's name (the link's endpoint for a link profile)."""
        return str(self.raw.get("model", {}).get("name") or Path(self.path).stem)

    @property
    def device(self) -> str:
        """Where it was measured (``machine.device``: cpu, cuda, ...; "" if not said)."""
        return str(self.raw.get("machine", {}).get("device", ""))

    def cells(self, field: str) -> list[dict[str, Any]]:
        """The cells of ``grid.<field>``."""
        value = self.raw["grid"][field]
        return value if isinstance(value, list) else [value]

    def seconds(self, field: str) -> dict[tuple[int, int], float]:
        """{(batch, gamma): median seconds} of ``grid.<field>`` (gamma 0 where not per gamma)."""
        return {
            (int(c.get("batch", 1)), int(c.get("gamma", 0))): c["median_ms"] / 1e3
            for c in self.cells(field)
        }

    def batches(self, field: str) -> list[int]:
        """The batch sizes measured in ``grid.<field>``, sorted."""
        return sorted({b for b, _ in self.seconds(field)})

    def gammas(self, field: str) -> list[int]:
        """The gammas measured in ``grid.<field>``, sorted."""
        return sorted({g for _, g in self.seconds(field)})

    def along_gamma(self, field: str, batch: int = 1) -> tuple[tuple[int, float], ...]:
        """(gamma, seconds) of ``grid.<field>`` at ``batch``, by gamma."""
        return tuple(sorted((g, s) for (b, g), s in self.seconds(field).items() if b == batch))


def interpolate(points: Sequence[tuple[int, float]], x: float) -> float:
    """Piecewise linear through ``points`` (sorted by x); beyond either end along the two
    nearest points' line, never below the nearer end's value."""
    if len(points) == 1:
        return points[0][1]
    hi = next((i for i, (px, _) in enumerate(points) if px >= x), len(points) - 1)
    hi = max(hi, 1)
    (x0, y0), (x1, y1) = points[hi - 1], points[hi]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if x > points[-1][0]:
        return max(y, points[-1][1])
    return max(y, points[0][1]) if x < points[0][0] else y


# ---------------------------------------------------------------------------------- measuring


def summary(times_s: Sequence[float]) -> dict[str, float | int]:
    """A cell from repeated timings in seconds: median, p10, p90 (ms) and n."""
    ms = sorted(1e3 * t for t in times_s)
    return {
        "median_ms": round(statistics.median(ms), 5),
        "p10_ms": round(_quantile(ms, 0.1), 5),
        "p90_ms": round(_quantile(ms, 0.9), 5),
        "n": len(ms),
    }


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of sorted values."""
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def alternated(cells: Sequence[Any], repeat: int) -> Sequence[Any]:
    """The order of one repeat: forward on even repeats, reversed on odd ones (this machine's
    speed drifts, so every cell sees early and late phases alike)."""
    return cells if repeat % 2 == 0 else list(reversed(cells))


def machine_info(device: str, dtype: str, device_name: str = "", threads: int = 0) -> dict:
    """What the profile was measured on (no torch import: its version from the metadata)."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "device": device,
        "device_name": device_name or _cpu_model(),
        "dtype": dtype,
        "torch_threads": threads,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def model_fingerprint(model_dir: str | Path) -> dict[str, Any]:
    """Who the model is, without loading it: ``config_sha256`` (config.json, keys sorted),
    ``parameters`` (summed from the safetensors headers; None without safetensors),
    ``files_sha256`` (the weight files' names and sizes) and ``id``, a hash of the three.
    Two profiles of one model agree on ``id`` whatever machine measured them."""
    root = Path(model_dir)
    config_path = root / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    weights = sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    listing = [[p.name, p.stat().st_size] for p in weights]
    parts = {
        "config_sha256": _sha(json.dumps(config, sort_keys=True)),
        "parameters": _parameter_count(weights),
        "files_sha256": _sha(json.dumps(listing)),
    }
    return {**parts, "id": _sha(json.dumps(parts, sort_keys=True))}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _parameter_count(files: Sequence[Path]) -> int | None:
    """Elements of every tensor in the safetensors files (their JSON headers only)."""
    tensors = [p for p in files if p.suffix == ".safetensors"]
    if not tensors:
        return None
    return sum(_safetensors_elements(p) for p in tensors)


def _safetensors_elements(path: Path) -> int:
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    shapes = (v["shape"] for k, v in header.items() if k != "__metadata__")
    return sum(math.prod(shape) for shape in shapes)


def new_profile(kind: str, model: dict[str, Any], machine: dict, grid: dict, **extra: Any) -> dict:
    """A measured profile's JSON object, the header fields first."""
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "protocol_version": PROTOCOL_VERSION,
        "kind": kind,
        "source": "measured",
        "model": model,
        "machine": machine,
        **extra,
        "grid": grid,
    }


def measured_profile(
    kind: str, model: dict[str, Any], device: str, dtype: str, grid: dict, **extra: Any
) -> dict[str, Any]:
    """A profile measured here of the model in ``model["path"]`` (fingerprinted) with torch on
    ``device`` (imported: it is loaded already wherever a model was timed)."""
    import torch

    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else ""
    machine = machine_info(device, dtype, name, torch.get_num_threads())
    model = {**model, "fingerprint": model_fingerprint(model["path"])}
    return new_profile(kind, model, machine, grid, **extra)


def settings(repeats: int, context: int, began: float) -> dict[str, Any]:
    """The ``settings`` and ``wall_s`` of a profile timed since ``began`` (perf_counter)."""
    wall = round(time.perf_counter() - began, 2)
    return {
        "settings": {"context_tokens": context, "repeats": repeats, "order": "alternated"},
        "wall_s": wall,
    }


def write_profile(raw: dict[str, Any], path: str | Path) -> Path:
    """Write ``raw`` as indented JSON (validated first: a bad measurement never lands)."""
    out = Path(path)
    check_profile(raw, str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(raw) + "\n")
    return out


def dumps(value: Any, indent: str = "") -> str:
    """JSON indented by two spaces, with every short object or list of scalars on one line (a
    grid cell per line; long notes one per line)."""
    inner = indent + "  "
    if isinstance(value, dict) and (not _flat(value.values()) or len(json.dumps(value)) > 160):
        items = [f"{inner}{json.dumps(k)}: {dumps(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    if isinstance(value, list) and (not _flat(value) or len(json.dumps(value)) > 100):
        items = [f"{inner}{dumps(v, inner)}" for v in value]
        return "[\n" + ",\n".join(items) + f"\n{indent}]"
    return json.dumps(value)


def _flat(values: Any) -> bool:
    """Whether every value is a scalar or a list of scalars."""
    return all(
        not isinstance(v, dict) and not (isinstance(v, list) and not _flat(v)) for v in values
    )


# ---------------------------------------------------------------------------------- loading


def load_profile(path: str | Path, kind: str | None = None) -> Profile:
    """Read and validate a profile (of ``kind``, when given); ProfileError if unusable."""
    where = str(path)
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ProfileError(f"{where}: cannot read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{where}: not JSON: {exc}") from None
    profile = check_profile(raw, where)
    if kind is not None and profile.kind != kind:
        raise ProfileError(f"{where}: kind: {profile.kind!r}, expected a {kind} profile")
    return profile


def check_profile(raw: Any, where: str) -> Profile:
    """Validate a profile's JSON object (``where`` names it in errors)."""
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: not a JSON object")
    _expect(raw, where, "schema", SCHEMA)
    _expect(raw, where, "schema_version", SCHEMA_VERSION)
    _expect(raw, where, "protocol_version", PROTOCOL_VERSION)
    kind, source = _choice(raw, where, "kind", KINDS), _choice(raw, where, "source", SOURCES)
    for name in ("machine", "model", "grid"):
        if not isinstance(_field(raw, where, name), dict):
            raise ProfileError(f"{where}: {name}: must be a JSON object")
    for name, per_gamma in GRIDS[kind]:
        _check_grid(raw["grid"], where, name, per_gamma)
    _check_batch_one(raw["grid"], where, [n for n, _ in GRIDS[kind]] if kind != "link" else [])
    return Profile(where, kind, source, raw)


def check_fingerprint(profile: Profile, model_dir: str | Path) -> None:
    """ProfileError unless ``profile`` was made of the model in ``model_dir``."""
    want = model_fingerprint(model_dir)["id"]
    have = (profile.raw["model"].get("fingerprint") or {}).get("id")
    if have != want:
        raise ProfileError(
            f"{profile.path}: model.fingerprint.id: {have} is not {model_dir}'s ({want}): "
            "a profile of another model"
        )


def _field(raw: dict[str, Any], where: str, name: str) -> Any:
    if name not in raw:
        raise ProfileError(f"{where}: {name}: missing")
    return raw[name]


def _expect(raw: dict[str, Any], where: str, name: str, want: Any) -> None:
    have = _field(raw, where, name)
    if have != want:
        raise ProfileError(
            f"{where}: {name}: {have!r} is not supported (this StarSD reads {want!r})"
        )


def _choice(raw: dict[str, Any], where: str, name: str, choices: Sequence[str]) -> str:
    have = _field(raw, where, name)
    if have not in choices:
        raise ProfileError(f"{where}: {name}: {have!r}, expected one of {', '.join(choices)}")
    return str(have)


def _check_grid(grid: dict[str, Any], where: str, name: str, per_gamma: bool) -> None:
    """Every cell positive and finite, and every batch measured at every gamma."""
    cells = _field(grid, f"{where}: grid", name)
    listed = isinstance(cells, list)  # a grid of cells per batch (a link's is one cell)
    cells = cells if listed else [cells]
    if not cells:
        raise ProfileError(f"{where}: grid.{name}: empty")
    keys = [
        _check_cell(cell, f"{where}: grid.{name}[{i}]", per_gamma, listed)
        for i, cell in enumerate(cells)
    ]
    _check_rectangular(keys, f"{where}: grid.{name}")


def _check_cell(cell: Any, where: str, per_gamma: bool, listed: bool) -> tuple[int, int]:
    if not isinstance(cell, dict):
        raise ProfileError(f"{where}: must be a JSON object")
    for name in ("median_ms", "p10_ms", "p90_ms"):
        if name in cell or name == "median_ms":
            _positive_time(_field(cell, where, name), f"{where}.{name}")
    batch = _count(_field(cell, where, "batch"), f"{where}.batch") if listed else 1
    gamma = _count(_field(cell, where, "gamma"), f"{where}.gamma") if per_gamma else 0
    return batch, gamma


def _positive_time(value: Any, where: str) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ProfileError(f"{where}: {value!r} is not a positive finite time")


def _count(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ProfileError(f"{where}: {value!r} is not an integer >= 1")
    return value


def _check_rectangular(keys: list[tuple[int, int]], where: str) -> None:
    if len(set(keys)) != len(keys):
        raise ProfileError(f"{where}: a (batch, gamma) cell appears twice")
    batches, gammas = sorted({b for b, _ in keys}), sorted({g for _, g in keys})
    for b in batches:
        missing = [g for g in gammas if (b, g) not in keys]
        if missing:
            raise ProfileError(f"{where}: batch {b} lacks gamma {missing} (a grid with holes)")


def _check_batch_one(grid: dict[str, Any], where: str, names: Sequence[str]) -> None:
    """A draft profile must hold S(1, g), a target profile T(1) and V(1, g): the planner's
    one-at-a-time and per-target figures (never guessed from larger batches)."""
    for name in names:
        cells = grid[name] if isinstance(grid[name], list) else [grid[name]]
        if not any(c.get("batch", 1) == 1 for c in cells):
            raise ProfileError(f"{where}: grid.{name}: no batch 1 (the planner needs B = 1)")


Progress = Callable[[str], None]  # where a measurement reports each step


def stderr_progress(line: str) -> None:
    """The measurements' default progress: one line on stderr."""
    print(line, file=sys.stderr, flush=True)
