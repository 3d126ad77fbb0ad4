"""``python -m edge.target`` refuses bad sampling parameters like argparse: exit 2, one line
naming the option (or the JSONL line and field) and its valid range, before loading any model.

A temperature such as 1e-38 that passed validation would make every draft fail on NaN
probabilities (the target re-opening its hub session over and over, then a traceback). Each test
points --model at a directory that does not exist, so loading a model first shows as a failure.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from procs import ENV, REPO

from edge import target

T_RANGE = "0 (greedy) or in [0.01, 100]"


def _run(*args: str, model: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edge.target", "--model", str(model), *args],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=REPO,
        timeout=120,
        check=False,
    )


def _refused(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "python -m edge.target: error:" in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def test_a_tiny_temperature_on_the_command_line_exits_2_naming_the_range(tmp_path: Path) -> None:
    proc = _run("--temperature", "1e-38", "--standalone", "--prompt", "x", model=tmp_path / "no")
    _refused(proc, "temperature 1e-38", T_RANGE)


def test_a_jsonl_line_with_a_tiny_temperature_exits_2_naming_line_and_range(
    tmp_path: Path,
) -> None:
    prompts = tmp_path / "in.jsonl"
    rows = [{"prompt": "fine", "temperature": 0.7}, {"prompt": "bad", "temperature": 1e-38}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    proc = _run("--prompts", str(prompts), "--standalone", model=tmp_path / "no")
    _refused(proc, f"{prompts}:2: temperature 1e-38", T_RANGE)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--temperature", "5e-324", "temperature 5e-324 is out of range"),
        ("--temperature", "nan", "temperature nan is out of range"),
        ("--temperature", "inf", "temperature inf is out of range"),
        ("--top-p", "0", "top_p 0.0 is out of range: must be in (0, 1]"),
        ("--top-p", "nan", "top_p nan is out of range"),
        ("--top-k", "-1", "top_k -1 is out of range"),
        ("--seed", "-1", "seed -1 is out of range"),
    ],
)
def test_bad_sampling_options_are_argparse_errors(
    option: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        target.parse_args(["--standalone", "--prompt", "x", option, value])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        # null and 1e400 once raised TypeError / OverflowError: a traceback, not an exit 2
        ("temperature", None, "temperature None is not a number"),
        ("temperature", "0.7", "temperature '0.7' is not a number"),
        ("temperature", float("inf"), "temperature inf is out of range"),
        ("temperature", 1e-300, "temperature 1e-300 is out of range"),
        ("top_k", 2.5, "top_k 2.5 is not an integer"),
        ("top_k", 10**30, "top_k 1000000000000000000000000000000 is out of range"),
        ("top_p", 0, "top_p 0.0 is out of range"),
        ("max_new_tokens", None, "max_new_tokens None is not an integer"),
    ],
)
def test_bad_jsonl_fields_are_refused_before_any_model_loads(
    tmp_path: Path, field: str, value: object, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"prompt": "x", field: value}) + "\n")
    argv = ["--model", str(tmp_path / "no"), "--prompts", str(prompts), "--standalone"]
    assert target.main(argv) == 2
    err = capsys.readouterr().err
    assert f"python -m edge.target: error: {prompts}:1: {message}" in err, err


def test_integral_floats_still_pass_for_integer_fields(tmp_path: Path) -> None:
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"prompt": "x", "top_k": 50.0, "max_new_tokens": 3.0}) + "\n")
    config = target.parse_args(["--prompts", str(prompts), "--standalone"])
    (request,) = target.load_requests(config)
    assert request.max_new_tokens == 3 and request.sampling is not None
    assert request.sampling.top_k == 50 and type(request.sampling.top_k) is int


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_max_batch_below_1_is_an_argparse_error(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches --max-batch 0 reaching the batcher (a ValueError traceback after loading)."""
    with pytest.raises(SystemExit) as info:
        target.parse_args(["--standalone", "--prompt", "x", "--max-batch", value])
    assert info.value.code == 2
    assert "--max-batch must be >= 1" in capsys.readouterr().err


def test_providers_without_the_onnxruntime_backend_is_an_argparse_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Catches --providers silently ignored by the torch backend (a user asking for TensorRT
    would run on whatever torch picks)."""
    with pytest.raises(SystemExit) as info:
        target.parse_args(["--standalone", "--prompt", "x", "--providers", "cuda"])
    assert info.value.code == 2
    assert "--providers applies to --backend onnxruntime only" in capsys.readouterr().err


def test_an_unavailable_backend_exits_2_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches an ImportError traceback when the onnxruntime backend (or its runtime) is not
    installed: one line naming the backend, exit 2."""
    monkeypatch.setitem(sys.modules, "edge.backends.onnxruntime", None)
    argv = [
        "--model",
        str(tmp_path / "no"),
        "--prompt",
        "x",
        "--standalone",
        "--backend",
        "onnxruntime",
    ]
    assert target.main(argv) == 2
    err = capsys.readouterr().err
    assert "python -m edge.target: error: the onnxruntime backend is not available" in err, err


def test_the_progress_bar_shows_for_prompts_on_a_terminal_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug caught: a bar drawn into a log file or a pipe (or never on a terminal)."""
    config = target.parse_args(["--prompts", str(tmp_path / "in.jsonl"), "--standalone"])
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert target._progress(config, 3).disable
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    bar = target._progress(config, 3)
    assert not bar.disable
    bar.close()
    single = target.parse_args(["--prompt", "x", "--standalone"])
    assert target._progress(single, 1).disable


async def test_the_cli_and_the_server_hand_the_run_path_the_same_options(
    llama_target: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a flag that reaches one front end and not the other: --serve built its batcher
    without gather, so ``--serve --no-gather`` was silently ignored."""
    from edge import generation
    from edge.backends.torch import TorchBackend
    from edge.batcher import Batcher

    seen: list[tuple[int, bool]] = []
    real = Batcher.__init__

    def spy(self: Batcher, backend: object, max_batch: int = 32, **options: object) -> None:
        seen.append((max_batch, bool(options.get("gather", True))))
        real(self, backend, max_batch, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(Batcher, "__init__", spy)
    backend = TorchBackend(llama_target)  # type: ignore[arg-type]
    flags = ["--no-gather", "--max-batch", "3"]
    served = generation.RequestQueue(
        target.parse_args(["--serve", *flags]), backend, None, None, lambda *a: None
    )  # type: ignore[arg-type]
    await served.aclose()
    await target._run_all(target.parse_args(["--prompt", "x", *flags]), backend, [], None, None)
    assert seen == [(3, False), (3, False)]
