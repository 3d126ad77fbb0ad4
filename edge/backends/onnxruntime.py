"""The ``onnxruntime`` verifier backend: an exported decoder (``python -m edge.export``) run by
ONNX Runtime, with execution providers tried in the order TensorRT -> CUDA -> CPU.

Needs onnxruntime, the tokenizers library, numpy and torch (for the shared cache and sampling
code), never transformers: the tokenizer comes from ``tokenizer.json``, and what the handshake and
stop rules need of the model from the export's manifest (:mod:`edge.backends.onnx_manifest`).

At start the backend refuses an export that does not match (a tokenizer whose fingerprint is not
the manifest's, a vocabulary or fingerprint other than the caller expects, a graph whose inputs
are not the manifest's) or that drifted (the manifest's probe, re-run here, beyond tolerance of
the torch logits recorded at export). A requested provider this onnxruntime build lacks is an
error naming the ones it has; with the default order, missing ones are skipped (logged).

TensorRT builds an engine per input-shape range and rebuilds it whenever a shape leaves the range
seen so far (onnxruntime #16889), which a growing KV cache would do every round: the provider is
given explicit min/opt/max shape profiles for batch, fed tokens and cached length
(:class:`TrtProfile`) and an engine cache directory. A batch or feed larger than the profile is
split into several runs (rows in groups, a long prefill in chunks); a cache longer than the
profile cannot be (the model's ``max_positions`` is lowered to it, so sequences stop in time).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge.backends import onnx_manifest
from edge.backends.base import ModelInfo, RowOutput
from edge.backends.onnx_manifest import Manifest, ManifestError
from starsd.batch import LayerBuffer, RaggedBatch, SequenceCache
from starsd.tree import TreeFeed

log = logging.getLogger("edge.backends.onnxruntime")

TRT, CUDA, CPU = "TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"
DEFAULT_PROVIDERS = (TRT, CUDA, CPU)
SHORT_NAMES = {"tensorrt": TRT, "trt": TRT, "cuda": CUDA, "cpu": CPU}
_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}
_TORCH = {"float32": torch.float32, "float16": torch.float16}


class BackendError(ValueError):
    """The backend cannot start: bad provider, mismatched or drifted export."""


@dataclass(frozen=True)
class TrtProfile:
    """TensorRT's shape profile (min 1 everywhere) and engine cache."""

    max_batch: int = 32  # rows per run; larger batches run in groups
    max_feed: int = 16  # tokens per row per run; longer feeds (prefill) run in chunks
    max_past: int | None = None  # cached positions; None: the model's max_positions
    opt_batch: int = 1
    opt_feed: int = 5  # [last, d_1 .. d_4]: verification at gamma 4
    opt_past: int = 128
    cache_dir: str | None = None  # engines and timing cache; None: <export dir>/trt-engines
    fp16: bool = False


@dataclass(frozen=True)
class OnnxOptions:
    """How to run an export."""

    providers: tuple[str, ...] | None = None  # None: TensorRT -> CUDA -> CPU, where available
    threads: int | None = None  # intra-op threads; None: torch's (the target's --threads)
    trt: TrtProfile = field(default_factory=TrtProfile)
    expect_vocab: int | None = None  # refuse an export of another vocabulary
    expect_fingerprint: str | None = None  # refuse an export of another tokenizer
    check_probe: bool = True  # refuse an export whose probe logits drifted


def parse_providers(text: str) -> tuple[str, ...]:
    """``"cuda,cpu"`` or full names -> provider names (the ``--providers`` option)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    return tuple(SHORT_NAMES.get(n.lower(), n) for n in names)


def resolve_providers(
    requested: Sequence[str] | None, available: Sequence[str], known: Sequence[str]
) -> list[str]:
    """The providers to open a session with, in order of preference.

    Raises:
        BackendError: a requested provider that does not exist, or that this onnxruntime build
            does not have (an explicit request is never silently dropped).
    """
    if requested is None:
        chosen = [p for p in DEFAULT_PROVIDERS if p in available]
        skipped = [p for p in DEFAULT_PROVIDERS if p not in available]
        if skipped:
            log.info("providers not in this onnxruntime build, skipped: %s", ", ".join(skipped))
        return chosen
    names = [SHORT_NAMES.get(p.lower(), p) for p in requested]
    unknown = [p for p in names if p not in known]
    if unknown or not names:
        raise BackendError(
            f"unknown execution provider(s) {unknown or names}; "
            f"known: {', '.join(SHORT_NAMES)} or {', '.join(known)}"
        )
    missing = [p for p in names if p not in available]
    if missing:
        raise BackendError(
            f"execution provider(s) {', '.join(missing)} not available in this "
            f"onnxruntime build (it has {', '.join(available)}); install "
            "onnxruntime-gpu (JetPack's build on a Jetson) or leave them out"
        )
    return names


def trt_shapes(manifest: Manifest, profile: TrtProfile) -> dict[str, str]:
    """``trt_profile_{min,opt,max}_shapes`` for every input of the decoder."""
    max_past = profile.max_past or manifest.max_positions or 2048
    sizes = {
        "min": (1, 1, 1),
        "opt": (profile.opt_batch, profile.opt_feed, profile.opt_past),
        "max": (profile.max_batch, profile.max_feed, max_past),
    }
    shapes = {}
    for which, (batch, feed, past) in sizes.items():
        dims: dict[str, tuple[int, ...]] = {
            "input_ids": (batch, feed),
            "position_ids": (batch, feed),
            "attention_mask": (batch, past + feed),
        }
        for i, heads in enumerate(manifest.kv_heads):
            for kv in ("key", "value"):
                dims[f"past.{i}.{kv}"] = (batch, heads, past, manifest.head_dim)
        text = ",".join(f"{name}:{'x'.join(map(str, d))}" for name, d in dims.items())
        shapes[f"trt_profile_{which}_shapes"] = text
    return shapes


def provider_options(
    name: str, manifest: Manifest, profile: TrtProfile, export_dir: Path
) -> dict[str, Any]:
    """ONNX Runtime options of one provider (TensorRT: shape profiles and the engine cache)."""
    if name == CUDA:  # TF32 matmuls would break float32 exactness against the torch model
        return {"use_tf32": 0} if manifest.dtype == "float32" else {}
    if name != TRT:
        return {}
    cache = Path(profile.cache_dir) if profile.cache_dir else export_dir / "trt-engines"
    cache.mkdir(parents=True, exist_ok=True)
    return {
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": str(cache),
        "trt_timing_cache_enable": True,
        "trt_timing_cache_path": str(cache),
        "trt_fp16_enable": profile.fp16 or manifest.dtype == "float16",
        **trt_shapes(manifest, profile),
    }


class OnnxBackend:
    """A :class:`edge.backends.base.VerifierBackend` over an export directory."""

    name = "onnxruntime"

    def __init__(
        self, export_dir: str | Path, options: OnnxOptions | None = None, dtype: str | None = None
    ) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.dir = Path(export_dir)
        self.options = options or OnnxOptions()
        self.manifest = Manifest.read(self.dir)
        if dtype is not None and dtype != self.manifest.dtype:
            raise BackendError(
                f"{self.dir} is a {self.manifest.dtype} export, {dtype} was asked "
                f"for: use --dtype {self.manifest.dtype} or export again"
            )
        self._check_expected()
        self.tokenizer = Tokenizer.from_file(str(self.dir / onnx_manifest.TOKENIZER_FILE))
        self._check_tokenizer()
        self.session = self._open_session(ort)
        self.providers: list[str] = list(self.session.get_providers())
        self._check_graph()
        self.limits = self.options.trt if self.providers[0] == TRT else None
        gpu = self.providers[0] in (TRT, CUDA) and torch.cuda.is_available()
        self.device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        self.dtype = _TORCH[self.manifest.dtype]
        self.min_past = 1 if self.limits else 0  # TensorRT profiles start at one cached column
        self.info = self._model_info()
        if self.options.check_probe:
            self.check_probe()
        log.info(
            "onnxruntime backend: %s (%s, vocab %d, %d layers) on %s, tokenizer %s",
            self.info.name,
            self.manifest.dtype,
            self.info.vocab_size,
            self.manifest.layers,
            " -> ".join(self.providers),
            self.info.tokenizer_fingerprint,
        )

    # ------------------------------------------------------------------ start checks

    def _check_expected(self) -> None:
        m, o = self.manifest, self.options
        if o.expect_vocab is not None and o.expect_vocab != m.vocab_size:
            raise BackendError(
                f"{self.dir}: exported vocab {m.vocab_size}, the target expects "
                f"{o.expect_vocab}: export the target model again"
            )
        fp = o.expect_fingerprint
        if fp is not None and fp != m.tokenizer_fingerprint:
            raise BackendError(
                f"{self.dir}: exported tokenizer fingerprint "
                f"{m.tokenizer_fingerprint}, the target expects {fp}"
            )

    def _check_tokenizer(self) -> None:
        """The tokenizer files must be the ones the manifest was written for."""
        from starsd.models import fingerprint_of  # no transformers: a pure hash

        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        fingerprint = fingerprint_of(vocab, self.manifest.special_tokens)
        if fingerprint != self.manifest.tokenizer_fingerprint:
            raise BackendError(
                f"{self.dir}: {onnx_manifest.TOKENIZER_FILE} has fingerprint "
                f"{fingerprint}, the manifest says "
                f"{self.manifest.tokenizer_fingerprint}: not this model's tokenizer"
            )
        if max(vocab.values(), default=-1) >= self.manifest.vocab_size:
            raise BackendError(
                f"{self.dir}: tokenizer ids reach {max(vocab.values())}, beyond "
                f"the model's vocab {self.manifest.vocab_size}"
            )

    def _open_session(self, ort: Any) -> Any:
        names = resolve_providers(
            self.options.providers, ort.get_available_providers(), ort.get_all_providers()
        )
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.options.threads or torch.get_num_threads()
        so.inter_op_num_threads = 1
        so.log_severity_level = 3  # errors only: ORT's own warnings are not per-event news
        providers = [
            (n, provider_options(n, self.manifest, self.options.trt, self.dir)) for n in names
        ]
        try:
            session = ort.InferenceSession(
                str(self.dir / onnx_manifest.MODEL_FILE), so, providers=providers
            )
        except Exception as exc:  # onnxruntime raises its own exception types
            raise BackendError(f"{self.dir}: onnxruntime could not load the model: {exc}") from exc
        used = session.get_providers()
        if used[0] != names[0]:  # e.g. CUDA requested but its libraries failed to load
            log.warning("provider %s could not start; falling back to %s", names[0], used[0])
        return session

    def _check_graph(self) -> None:
        m = self.manifest
        inputs = [i.name for i in self.session.get_inputs()]
        outputs = [o.name for o in self.session.get_outputs()]
        if inputs != onnx_manifest.input_names(m.layers) or outputs != onnx_manifest.output_names(
            m.layers
        ):
            raise BackendError(
                f"{self.dir}: the graph's inputs/outputs are not those of a "
                f"{m.layers}-layer decoder the manifest describes"
            )
        width = self.session.get_outputs()[0].shape[-1]
        if isinstance(width, int) and width != m.vocab_size:
            raise BackendError(
                f"{self.dir}: the graph's logits are {width} wide, the manifest "
                f"says vocab {m.vocab_size}: manifest and model do not match"
            )

    def _model_info(self) -> ModelInfo:
        m = self.manifest
        limit = m.max_positions
        if self.limits is not None:  # a cache beyond the TensorRT profile cannot run
            cap = self.limits.max_past or limit
            limit = min(limit, cap) if limit and cap else (limit or cap)
        return ModelInfo(
            m.name,
            m.vocab_size,
            m.hidden_size,
            m.tokenizer_fingerprint,
            frozenset(m.eos_token_ids),
            limit,
            supports_trees=False,  # the exported graph takes no attention mask
        )

    def check_probe(self) -> float:
        """Re-run the manifest's probe; BackendError if its logits drifted beyond tolerance.
        Returns the drift (<= 0: within tolerance)."""
        probe = self.manifest.probe
        first = self.forward([SequenceCache()], [probe.first])[0]
        second = self.forward([first.cache], [probe.second])[0]
        drift = probe.drift(second.logits.numpy())
        if drift > 0:
            raise BackendError(
                f"{self.dir}: probe logits differ from the torch model's by "
                f"{drift:.3g} beyond tolerance (atol {probe.atol}, rtol "
                f"{probe.rtol}) on {' -> '.join(self.providers)}: refusing it"
            )
        return drift

    # ------------------------------------------------------------------ backend API

    def close(self) -> None:
        """Release the session (and its TensorRT engines or CUDA memory)."""
        self.session = None

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt (tokenizer.json's own special-token convention)."""
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids, special tokens dropped."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def forward(
        self,
        caches: Sequence[SequenceCache],
        feeds: Sequence[Sequence[int]],
        taps: Sequence[int] = (),
        trees: Sequence[TreeFeed | None] | None = None,
    ) -> list[RowOutput]:
        """One ragged forward (see :class:`edge.backends.base.VerifierBackend`); batches and
        feeds beyond the TensorRT profile run as several session runs. The exported graph
        outputs the last hidden state only: ``taps`` () or (-1,) (``info.layers`` is 0), and
        takes no attention mask: no token trees."""
        if trees is not None and any(t is not None for t in trees):
            raise ValueError(
                "the ONNX target's graph takes no attention mask: it cannot verify trees"
            )
        if tuple(taps) not in ((), (-1,)):
            raise ValueError(f"an ONNX target taps only its last hidden state, not {list(taps)}")
        features = bool(taps)
        self._check_rows(caches, feeds)
        max_batch = self.limits.max_batch if self.limits else len(feeds)
        max_feed = self.limits.max_feed if self.limits else max(map(len, feeds))
        out: list[RowOutput] = []
        for start in range(0, len(feeds), max_batch):
            rows = slice(start, start + max_batch)
            chunk = [list(f) for f in feeds[rows]]
            out.extend(self._chunked(list(caches[rows]), chunk, features, max_feed))
        return out

    def _check_rows(self, caches: Sequence[SequenceCache], feeds: Sequence[Sequence[int]]) -> None:
        if len(caches) != len(feeds) or not feeds or min(map(len, feeds)) < 1:
            raise ValueError("forward needs one cache and a non-empty feed per row")
        limit = self.info.max_positions
        longest = max(c.length + len(f) for c, f in zip(caches, feeds, strict=True))
        if limit is not None and longest > limit:
            raise ValueError(f"{longest} positions exceed the model's limit of {limit}")
        if any(not 0 <= t < self.info.vocab_size for f in feeds for t in f):
            raise ValueError(f"token ids must lie in [0, {self.info.vocab_size})")

    def _chunked(
        self, caches: list[SequenceCache], feeds: list[list[int]], features: bool, max_feed: int
    ) -> list[RowOutput]:
        """Run the rows, feeding at most ``max_feed`` tokens per row and run."""
        if max(map(len, feeds)) <= max_feed:
            return self._run(caches, feeds, features)
        # A long prefill on TensorRT: chunks of max_feed, each after the last one's cache.
        pieces: list[list[RowOutput]] = [[] for _ in feeds]
        done = [0] * len(feeds)
        while todo := [i for i, f in enumerate(feeds) if done[i] < len(f)]:
            chunk = [feeds[i][done[i] : done[i] + max_feed] for i in todo]
            outs = self._run([caches[i] for i in todo], chunk, features)
            for i, o, c in zip(todo, outs, chunk, strict=True):
                pieces[i].append(o)
                caches[i], done[i] = o.cache, done[i] + len(c)
        return [_joined(p) for p in pieces]

    def _run(
        self, caches: list[SequenceCache], feeds: list[list[int]], features: bool
    ) -> list[RowOutput]:
        """One session run of a ragged batch: gather, run, scatter."""
        batch = RaggedBatch(tuple(c.length for c in caches), tuple(map(len, feeds)), 0)
        pad = max(0, self.min_past - batch.cached_width)  # masked columns TensorRT needs
        width = pad + batch.cached_width + batch.fed_width
        inputs = {
            "input_ids": batch.input_ids(feeds),
            "position_ids": batch.feed_positions(),
            "attention_mask": torch.cat(
                [torch.zeros(batch.rows, pad, dtype=torch.long), batch.key_mask(width - pad)], dim=1
            ),
        }
        inputs.update(self._gather(batch, caches, pad))
        outputs = self._bind_and_run(inputs, batch.rows, batch.fed_width, width)
        buffers = [
            LayerBuffer(
                outputs[f"present.{i}.key"][:, :, pad:],
                outputs[f"present.{i}.value"][:, :, pad:],
                width - pad,
            )
            for i in range(self.manifest.layers)
        ]
        logits = outputs["logits"].float().cpu()  # [B, F, V]
        hidden = outputs["hidden"].float().cpu() if features else None  # [B, F, H]
        return [
            RowOutput(
                logits[row, :f],
                None if hidden is None else hidden[row, :f],
                batch.scatter(buffers, row, 0),
            )
            for row, f in enumerate(batch.fed)
        ]

    def _gather(
        self, batch: RaggedBatch, caches: list[SequenceCache], pad: int
    ) -> dict[str, torch.Tensor]:
        """Past keys/values [B, heads, pad + C, d] per layer, each row right-aligned, zeros
        elsewhere. (RaggedBatch.gather allocates room for in-place appends that ONNX Runtime
        does not make; the graph returns the grown cache as new outputs instead.)"""
        c_max, m = batch.cached_width, self.manifest
        past = {}
        for layer, heads in enumerate(m.kv_heads):
            size = (batch.rows, heads, pad + c_max, m.head_dim)
            keys = torch.zeros(size, dtype=self.dtype, device=self.device)
            values = torch.zeros(size, dtype=self.dtype, device=self.device)
            for row, cache in enumerate(caches):
                if batch.cached[row]:
                    k, v = cache.layers[layer]  # [heads, c_i, d]
                    keys[row, :, pad + c_max - batch.cached[row] :] = k
                    values[row, :, pad + c_max - batch.cached[row] :] = v
            past[f"past.{layer}.key"], past[f"past.{layer}.value"] = keys, values
        return past

    def _bind_and_run(
        self, inputs: dict[str, torch.Tensor], rows: int, fed: int, width: int
    ) -> dict[str, torch.Tensor]:
        """session.run over torch tensors bound in place (no copies on CPU; on CUDA the cache
        stays on the device), outputs preallocated with their known shapes."""
        m = self.manifest
        outputs = {
            "logits": self._empty(rows, fed, m.vocab_size),
            "hidden": self._empty(rows, fed, m.hidden_size),
        }
        for layer, heads in enumerate(m.kv_heads):
            for kv in ("key", "value"):
                outputs[f"present.{layer}.{kv}"] = self._empty(rows, heads, width, m.head_dim)
        binding = self.session.io_binding()
        bound = {name: t.to(self.device).contiguous() for name, t in inputs.items()}
        for name, tensor in bound.items():  # ``bound`` keeps them alive until the run ends
            binding.bind_input(name, *self._where(tensor))
        for name, tensor in outputs.items():
            binding.bind_output(name, *self._where(tensor))
        if self.device.type == "cuda":  # torch's copies run on its own stream: finish them first
            torch.cuda.synchronize(self.device)
        self.session.run_with_iobinding(binding)
        binding.synchronize_outputs()  # the outputs are complete before torch reads them
        return outputs

    def _empty(self, *shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _where(self, tensor: torch.Tensor) -> tuple[str, int, Any, list[int], int]:
        """(device type, device id, element type, shape, pointer) for an io_binding call."""
        kind = "cuda" if tensor.device.type == "cuda" else "cpu"
        return (
            kind,
            tensor.device.index or 0,
            _NUMPY[tensor.dtype],
            list(tensor.shape),
            tensor.data_ptr(),
        )


def _joined(pieces: list[RowOutput]) -> RowOutput:
    """One row's chunked results as one: logits and features concatenated, the last cache."""
    feats = [p.features for p in pieces]
    features = None if feats[0] is None else torch.cat(feats, dim=0)  # type: ignore[arg-type]
    return RowOutput(torch.cat([p.logits for p in pieces], dim=0), features, pieces[-1].cache)


def load(
    model_dir: str | Path, device: str = "cpu", dtype: str = "float32", **options: Any
) -> OnnxBackend:
    """The factory's entry point (:func:`edge.backends.load_backend`): open an export directory.

    ``device`` is not used: the providers decide (TensorRT -> CUDA -> CPU, or ``providers=``).
    ``dtype`` must be the export's (a float16 export is made with ``edge.export --dtype``).
    ``options`` are :class:`OnnxOptions` fields (``providers`` may be a comma-separated string).
    ManifestError / BackendError (ValueErrors) say why an export is refused.
    """
    del device
    if isinstance(options.get("providers"), str):
        options["providers"] = parse_providers(options["providers"])
    started = time.perf_counter()
    backend = OnnxBackend(model_dir, OnnxOptions(**options), dtype=dtype)
    log.debug("loaded %s in %.2f s", model_dir, time.perf_counter() - started)
    return backend


__all__ = [
    "BackendError",
    "ManifestError",
    "OnnxBackend",
    "OnnxOptions",
    "TrtProfile",
    "load",
    "parse_providers",
    "resolve_providers",
]
