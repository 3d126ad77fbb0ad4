"""The ONNX Runtime backend and ``python -m edge.export``.

Tiny Llama- and GPT-2-shaped targets are built from a config, loaded through starsd.models,
exported once per session, and run by ONNX Runtime's CPU provider in float32; the torch model is
the reference (transformers ``generate()`` for greedy output).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from procs import reference

from edge import export as exporter
from edge.backends import onnx_manifest
from edge.backends.greedy import greedy
from edge.backends.onnx_manifest import Manifest, ManifestError
from edge.backends.onnxruntime import (
    CPU,
    CUDA,
    DEFAULT_PROVIDERS,
    TRT,
    BackendError,
    OnnxBackend,
    OnnxOptions,
    TrtProfile,
    load,
    parse_providers,
    resolve_providers,
    trt_shapes,
)
from starsd import models
from starsd.batch import SequenceCache

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["To be, or not to be", "Now is the winter", "All"]
CPU_ONLY = OnnxOptions(providers=(CPU,), threads=1)


@pytest.fixture(scope="session")
def exports(
    model_root: Path, llama_pair: tuple[Path, Path], gpt2_pair: tuple[Path, Path]
) -> dict[str, tuple[Path, Path]]:
    """family -> (model dir, export dir), each exported once per session."""
    out = {}
    for family, (target, _) in (("llama", llama_pair), ("gpt2", gpt2_pair)):
        directory = model_root / f"{family}-onnx"
        if not directory.exists():
            exporter.export(target, directory)
        out[family] = (target, directory)
    return out


def copy_export(exports: dict[str, tuple[Path, Path]], tmp_path: Path) -> Path:
    """A private copy of the llama export, for a test to tamper with."""
    return Path(shutil.copytree(exports["llama"][1], tmp_path / "export"))


def edit_manifest(directory: Path, **changes: object) -> None:
    path = directory / onnx_manifest.MANIFEST_FILE
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


# --------------------------------------------------------------------------- export


def test_export_writes_a_manifest_that_describes_the_model(
    exports: dict[str, tuple[Path, Path]], llama_target: models.LoadedModel
) -> None:
    """Catches a manifest whose handshake fields differ from the torch model's (the hub would
    then accept or refuse the target for the wrong reasons)."""
    manifest = Manifest.read(exports["llama"][1])
    t = llama_target
    assert (manifest.vocab_size, manifest.tokenizer_fingerprint) == (
        t.vocab_size,
        t.tokenizer_fingerprint,
    )
    assert set(manifest.eos_token_ids) == set(t.eos_token_ids)
    assert manifest.max_positions == t.max_positions
    assert [(h, manifest.head_dim) for h in manifest.kv_heads] == models.kv_shapes(t)
    assert manifest.hidden_size == models.hidden_size(t)
    assert manifest.source_hash == onnx_manifest.source_hash(exports["llama"][0])
    assert (exports["llama"][1] / "tokenizer.json").is_file()


def test_export_refuses_when_onnx_runtime_disagrees_with_torch(
    exports: dict[str, tuple[Path, Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches an export that is kept although ONNX Runtime's logits differ from torch's (here
    the torch reference is shifted; a mis-traced graph looks the same to the check)."""
    good = exports["llama"][1]

    def copy_graph(loaded: models.LoadedModel, path: Path, opset: int | None) -> int:
        for f in good.glob("model.onnx*"):
            shutil.copy(f, path.parent / f.name)
        return Manifest.read(good).opset

    real = exporter.torch_logits
    monkeypatch.setattr(exporter, "export_graph", copy_graph)
    monkeypatch.setattr(exporter, "torch_logits", lambda *a: real(*a) + 0.01)
    out = tmp_path / "bad"
    with pytest.raises(exporter.ExportError, match="probe logits differ"):
        exporter.export(exports["llama"][0], out)
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing left behind


def test_export_will_not_overwrite_a_directory(
    exports: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """Catches an export that silently replaces a non-empty directory."""
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(exporter.ExportError, match="not empty"):
        exporter.export(exports["llama"][0], tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "mine"


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_ragged_forward_matches_torch(family: str, exports: dict[str, tuple[Path, Path]]) -> None:
    """Catches a wrong ragged layout (cache alignment, mask, positions, feed padding) or a
    scatter that returns the wrong columns: every row of one batch, with different cached and
    fed lengths, against torch on that sequence alone, then one more step from the returned
    caches."""
    model_dir, export_dir = exports[family]
    backend, loaded = OnnxBackend(export_dir, CPU_ONLY), models.load_causal_lm(model_dir)
    ids = [[*backend.encode(p), 7, 9, 11, 13, 15, 17, 19, 21] for p in PROMPTS]
    rows = [(0, 4), (3, 1), (6, 3)]  # (cached, fed)
    caches = [
        backend.forward([SequenceCache()], [ids[i][:c]])[0].cache if c else SequenceCache()
        for i, (c, _) in enumerate(rows)
    ]
    feeds = [ids[i][c : c + f] for i, (c, f) in enumerate(rows)]
    outs = backend.forward(caches, feeds, taps=(-1,))
    for i, ((c, f), out) in enumerate(zip(rows, outs, strict=True)):
        cache = models.new_cache(loaded)
        if c:
            models.forward(loaded, ids[i][:c], cache)
        logits, features = models.forward_with_features(loaded, feeds[i], cache)
        torch.testing.assert_close(out.logits, logits, atol=1e-4, rtol=1e-4)
        assert out.features is not None
        torch.testing.assert_close(out.features, features, atol=1e-4, rtol=1e-4)
        assert out.cache.length == c + f and caches[i].length == c  # inputs left as they were
        step = backend.forward([out.cache], [[5]])[0].logits
        torch.testing.assert_close(step, models.forward(loaded, [5], cache), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_equals_transformers_generate(
    family: str, exports: dict[str, tuple[Path, Path]]
) -> None:
    """Catches any loss of exactness: greedy tokens of three prompts decoded together through
    the ONNX Runtime backend equal transformers' generate() on each alone, token for token."""
    model_dir, export_dir = exports[family]
    backend = OnnxBackend(export_dir, CPU_ONLY)
    got = greedy(backend, [backend.encode(p) for p in PROMPTS], 24)
    assert got == [reference(model_dir, p, 24) for p in PROMPTS]


def test_tokenizer_matches_transformers(
    exports: dict[str, tuple[Path, Path]], llama_target: models.LoadedModel
) -> None:
    """Catches a tokenizer.json that encodes or decodes unlike the transformers tokenizer (the
    prompt's ids and the returned text would differ from the torch backend's)."""
    backend = OnnxBackend(exports["llama"][1], CPU_ONLY)
    for text in [*PROMPTS, "odd   spacing\nand lines", "<|eos|> special"]:
        ids = models.encode_text(llama_target, text)
        assert backend.encode(text) == ids
        assert backend.decode(ids) == models.decode_ids(llama_target, ids)


def test_profile_limits_split_batches_and_long_feeds(exports: dict[str, tuple[Path, Path]]) -> None:
    """Catches a wrong TensorRT-profile fallback (run on the CPU provider with the same code):
    a batch larger than max_batch runs in groups, a prefill longer than max_feed in chunks, and
    an empty cache gets one masked column; the results equal an unlimited run."""
    plain = OnnxBackend(exports["llama"][1], CPU_ONLY)
    limited = OnnxBackend(exports["llama"][1], CPU_ONLY)
    limited.limits, limited.min_past = TrtProfile(max_batch=2, max_feed=3), 1
    prompts = [plain.encode(p) + [3] * k for k, p in enumerate(PROMPTS * 2)]
    first = plain.forward([SequenceCache() for _ in prompts], prompts, taps=(-1,))
    second = limited.forward([SequenceCache() for _ in prompts], prompts, taps=(-1,))
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.features, b.features, atol=1e-5, rtol=1e-5)
        assert a.cache.length == b.cache.length
        torch.testing.assert_close(a.cache.layers[-1][0], b.cache.layers[-1][0])
    assert greedy(limited, prompts[:3], 8) == greedy(plain, prompts[:3], 8)


# --------------------------------------------------------------------------- refusals


def test_an_export_of_another_model_is_refused(
    exports: dict[str, tuple[Path, Path]], tmp_path: Path, llama_target: models.LoadedModel
) -> None:
    """Catches a target that starts on an export whose vocabulary or tokenizer is not the one
    it expects, or whose manifest does not describe its graph or tokenizer files."""
    directory = exports["llama"][1]
    with pytest.raises(BackendError, match="vocab 320, the target expects 999"):
        OnnxBackend(directory, OnnxOptions(providers=(CPU,), expect_vocab=999))
    with pytest.raises(BackendError, match=r"fingerprint .* expects beef"):
        OnnxBackend(directory, OnnxOptions(providers=(CPU,), expect_fingerprint="beef"))
    expected = OnnxOptions(
        providers=(CPU,),
        expect_vocab=llama_target.vocab_size,
        expect_fingerprint=llama_target.tokenizer_fingerprint,
    )
    assert OnnxBackend(directory, expected).info.vocab_size == llama_target.vocab_size
    tampered = copy_export(exports, tmp_path)
    edit_manifest(tampered, tokenizer_fingerprint="0123456789abcdef")
    with pytest.raises(BackendError, match="not this model's tokenizer"):
        OnnxBackend(tampered, CPU_ONLY)


def test_a_manifest_with_another_vocab_is_refused(
    exports: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """Catches a manifest whose vocabulary is not the graph's (logits of another width would
    reach the sampler and the hub's handshake)."""
    tampered = copy_export(exports, tmp_path)
    manifest = json.loads((tampered / onnx_manifest.MANIFEST_FILE).read_text())
    wider = [[*row, 0.0] for row in manifest["probe"]["logits"]]
    edit_manifest(tampered, vocab_size=321, probe={**manifest["probe"], "logits": wider})
    with pytest.raises(BackendError, match="logits are 320 wide, the manifest says vocab 321"):
        OnnxBackend(tampered, CPU_ONLY)


def test_a_drifted_export_is_refused_at_start(
    exports: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """Catches a target that starts on a model whose logits drifted from the torch model's
    (here the recorded reference moves by 1e-2; 1e-6 stays within float tolerance)."""
    tampered = copy_export(exports, tmp_path)
    probe = json.loads((tampered / onnx_manifest.MANIFEST_FILE).read_text())["probe"]
    for delta, refused in ((1e-6, False), (1e-2, True)):
        logits = [list(row) for row in probe["logits"]]
        logits[1][5] += delta
        edit_manifest(tampered, probe={**probe, "logits": logits})
        if refused:
            with pytest.raises(BackendError, match=r"probe logits differ .* refusing"):
                OnnxBackend(tampered, CPU_ONLY)
        else:
            assert OnnxBackend(tampered, CPU_ONLY).check_probe() <= 0


def test_a_broken_export_directory_is_a_clear_error(tmp_path: Path) -> None:
    """Catches a traceback (KeyError, JSONDecodeError) instead of a message naming the file."""
    with pytest.raises(ManifestError, match="not an export directory"):
        OnnxBackend(tmp_path)
    (tmp_path / onnx_manifest.MANIFEST_FILE).write_text("{not json")
    with pytest.raises(ManifestError, match="malformed"):
        OnnxBackend(tmp_path)
    (tmp_path / onnx_manifest.MANIFEST_FILE).write_text('{"format": 99}')
    with pytest.raises(ManifestError, match="format 99"):
        OnnxBackend(tmp_path)


def test_a_wrong_dtype_is_refused(exports: dict[str, tuple[Path, Path]]) -> None:
    """Catches a float32 export silently run where float16 was asked for (or the reverse)."""
    with pytest.raises(BackendError, match="float32 export, float16 was asked"):
        load(exports["llama"][1], "cpu", "float16", providers="cpu")


def test_bad_rows_are_refused_before_running(exports: dict[str, tuple[Path, Path]]) -> None:
    """Catches an out-of-vocabulary id or an over-long sequence reaching the session (a crash
    in ONNX Runtime's Gather, or silently wrong positions)."""
    backend = OnnxBackend(exports["gpt2"][1], CPU_ONLY)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 320\)"):
        backend.forward([SequenceCache()], [[5, 320]])
    with pytest.raises(ValueError, match="257 positions exceed the model's limit of 256"):
        backend.forward([SequenceCache()], [[5] * 257])
    with pytest.raises(ValueError, match="non-empty feed"):
        backend.forward([SequenceCache()], [[]])


# --------------------------------------------------------------------------- providers


def test_provider_resolution() -> None:
    """Catches an unknown or unavailable provider that is silently dropped when asked for, and
    a default order other than TensorRT -> CUDA -> CPU."""
    known = [TRT, CUDA, "OpenVINOExecutionProvider", CPU]
    assert resolve_providers(None, [CPU], known) == [CPU]
    assert resolve_providers(None, [CPU, CUDA, TRT], known) == list(DEFAULT_PROVIDERS)
    assert resolve_providers(parse_providers("cuda, CPU"), [CUDA, CPU], known) == [CUDA, CPU]
    with pytest.raises(BackendError, match=r"unknown execution provider.*'NoSuchProvider'"):
        resolve_providers(["NoSuchProvider"], [CPU], known)
    with pytest.raises(
        BackendError,
        match=r"CUDAExecutionProvider not available .*\(it has "
        r"CPUExecutionProvider\)",
    ):
        resolve_providers(["cuda", "cpu"], [CPU], known)


def test_an_unavailable_provider_is_a_clear_error(
    exports: dict[str, tuple[Path, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches a backend that starts on another provider than the one explicitly asked for,
    and ``edge.target --providers`` not reaching the backend (or failing with a traceback)."""
    import onnxruntime as ort

    from edge import target

    if TRT in ort.get_available_providers():
        pytest.skip("this onnxruntime build has TensorRT")
    with pytest.raises(BackendError, match="TensorrtExecutionProvider not available"):
        load(exports["llama"][1], providers="tensorrt")
    with pytest.raises(BackendError, match="unknown execution provider"):
        load(exports["llama"][1], providers="warp-drive")
    argv = [
        "--model",
        str(exports["llama"][1]),
        "--prompt",
        "x",
        "--standalone",
        "--backend",
        "onnxruntime",
        "--providers",
        "tensorrt,cpu",
    ]
    assert target.main(argv) == 2
    assert "error: " in (err := capsys.readouterr().err) and "TensorrtExecutionProvider" in err


def test_trt_profile_covers_every_input(exports: dict[str, tuple[Path, Path]]) -> None:
    """Catches a TensorRT profile that leaves an input out or lets the cache grow past it
    (either makes TensorRT rebuild its engine mid-sequence, onnxruntime #16889)."""
    manifest = Manifest.read(exports["llama"][1])
    shapes = trt_shapes(manifest, TrtProfile(max_batch=8, max_feed=16, opt_past=64))
    for which in ("min", "opt", "max"):
        names = [item.split(":")[0] for item in shapes[f"trt_profile_{which}_shapes"].split(",")]
        assert names == onnx_manifest.input_names(manifest.layers)
    assert "past.0.key:1x2x1x16" in shapes["trt_profile_min_shapes"]
    assert "past.2.value:8x2x256x16" in shapes["trt_profile_max_shapes"]
    assert "attention_mask:8x272" in shapes["trt_profile_max_shapes"]
    assert "input_ids:1x5" in shapes["trt_profile_opt_shapes"]


def _gpu_provider(name: str) -> None:
    import onnxruntime as ort

    if name not in ort.get_available_providers():
        pytest.skip(f"{name} not in this onnxruntime build")


@pytest.mark.gpu
@pytest.mark.parametrize("provider", [CUDA, TRT])
def test_gpu_provider_greedy_equals_cpu(
    provider: str, exports: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """Catches a GPU provider path (device binding, TensorRT profile and engine cache) that
    changes greedy output: float32 on the GPU equals the CPU provider token for token."""
    _gpu_provider(provider)
    trt = TrtProfile(cache_dir=str(tmp_path / "engines"))
    gpu = OnnxBackend(exports["llama"][1], OnnxOptions(providers=(provider,), trt=trt))
    assert gpu.providers[0] == provider
    cpu = OnnxBackend(exports["llama"][1], CPU_ONLY)
    prompts = [cpu.encode(p) for p in PROMPTS]
    assert greedy(gpu, prompts, 24) == greedy(cpu, prompts, 24)
    if provider == TRT:
        assert any((tmp_path / "engines").iterdir()), "no TensorRT engine was cached"


# --------------------------------------------------------------------------- slim install

_SLIM = """
import importlib.abc, json, sys

class NoTransformers(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("transformers", "safetensors"):
            raise ImportError(f"{name} is not installed (slim edge install)")
        return None

sys.meta_path.insert(0, NoTransformers())
try:
    import transformers  # noqa: F401
    sys.exit("the blocker does not work")
except ImportError:
    pass
import edge.target  # noqa: F401
from edge.backends.greedy import greedy
from edge.backends.onnxruntime import load
backend = load(sys.argv[1], providers="cpu", threads=1)
tokens = greedy(backend, [backend.encode(p) for p in json.loads(sys.argv[2])], 16)
heavy = sorted(m for m in sys.modules
               if m.split(".")[0] in ("transformers", "safetensors") or m.startswith("starsd.hub"))
print(json.dumps({"tokens": tokens, "heavy": heavy}))
"""


def test_slim_target_runs_without_transformers(exports: dict[str, tuple[Path, Path]]) -> None:
    """Catches a transformers import on the slim path (edge.target or the ONNX Runtime
    backend, at import or at run time): a fresh interpreter where transformers cannot be
    imported generates greedily through the backend, token for token as generate() does, and
    has imported nothing of the hub either."""
    model_dir, export_dir = exports["llama"]
    env = {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", _SLIM, str(export_dir), json.dumps(PROMPTS)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["heavy"] == []
    assert result["tokens"] == [reference(model_dir, p, 16) for p in PROMPTS]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_committed_target_greedy_equals_generate(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Catches an exporter or backend that is exact on the tiny models but not on the committed
    default target (20 layers, its own tokenizer, float16 weights loaded as float32): greedy
    through the ONNX Runtime backend equals generate() token for token. (Slow: the export
    takes minutes on 2 cores.)"""
    export_dir = tmp_path_factory.mktemp("default") / "starsd-target-onnx"
    exporter.export(models.TOY_TARGET_DIR, export_dir)
    backend = OnnxBackend(export_dir, CPU_ONLY)
    prompts = ["HAMLET:\nTo be, or not to be,", "ROMEO:\nBut soft, what light"]
    got = greedy(backend, [backend.encode(p) for p in prompts], 32)
    assert got == [reference(models.TOY_TARGET_DIR, p, 32) for p in prompts]


@pytest.mark.slow
def test_a_float16_export_runs_and_checks_itself(
    exports: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """Catches a float16 export (the GPU's choice) that cannot be made or run: it passes its
    own check against the torch model in float16, keeps a float16 cache and returns float32
    logits close to the float32 export's."""
    model_dir, full = exports["llama"]
    exporter.export(model_dir, tmp_path / "fp16", dtype="float16")
    half = load(tmp_path / "fp16", "cpu", "float16", providers="cpu")
    prompt = half.encode(PROMPTS[0])
    row = half.forward([SequenceCache()], [prompt])[0]
    assert row.logits.dtype == torch.float32 and row.cache.layers[0][0].dtype == torch.float16
    ref = OnnxBackend(full, CPU_ONLY).forward([SequenceCache()], [prompt])[0].logits
    torch.testing.assert_close(row.logits, ref, atol=5e-2, rtol=5e-2)
