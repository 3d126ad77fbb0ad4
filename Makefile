# StarSD - one draft hub, many target verifiers.
# `make demo` and `make test` do all set-up themselves on a fresh machine.

PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; `pip install torch==2.13.0` takes the wheel this machine keeps on disk.
# A system torch (e.g. JetPack's on a Jetson) is reused instead: the venv then sees site-packages.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
PYTEST_ARGS ?=
BENCH_ARGS = $(if $(QUICK),--quick)

.PHONY: venv install test test-fast test-load hostile-probe lint demo models eval-models bench bench-scale bench-lan bench-hubs \
	bench-service bench-onnx check-gpu load \
	analytic clean help

help:
	@echo "make demo        one hub + 3 targets on the default models, speedup vs standalone"
	@echo "make test        install everything and run the whole test suite (CPU)"
	@echo "make test-fast   unit and socket tests only (no multi-process end-to-end tests)"
	@echo "make lint        ruff + mypy"
	@echo "make test-load   a legitimate target's throughput beside each attack (minutes)"
	@echo "make hostile-probe  hub RSS and legit throughput under attacks 3-6 -> results/hostile.json [QUICK=1]"
	@echo "make models      re-train the default target/draft pair (~5 min on 2 cores)"
	@echo "make eval-models re-measure the default pair into results/eval-models.json"
	@echo "make eagle-head  train + evaluate the EAGLE-1 head -> models/starsd-eagle (~5 min)"
	@echo "make bench       all modes side by side, one hub batched vs --max-batch 1, one hub + one target vs"
	@echo "                 transformers' assisted generation, pre-draft hit rate -> results/bench.json + .png  [QUICK=1]"
	@echo "make bench-scale emulated targets up to N=256 (QUICK 128), one-at-a-time vs batched hub, N_full, S(B),"
	@echo "                 RSS, fixed gamma vs --gamma auto -> results/bench-scale.json + .png [QUICK=1: < 4 min]"
	@echo "make bench-hubs  one hub vs two (emulated sweep, hubs pinned to CPUs 0 and 1) and a hub SIGKILLed under"
	@echo "                 real targets -> results/bench-hubs.json + .png [QUICK=1: < 2 min]"
	@echo "make bench-service  S(B) of the draft LLM and EAGLE head in process -> results/bench-service.json [QUICK=1]"
	@echo "make bench-lan   hub and targets in network namespaces -> results/bench-lan.json [QUICK=1]"
	@echo "make bench-onnx  onnxruntime CPU vs torch CPU, greedy tok/s on the default target -> results/bench-onnx.json"
	@echo "make check-gpu   (NVIDIA GPU) onnxruntime CUDA/TensorRT vs torch -> results/gpu-backends.json"
	@echo "make load        streaming clients against edge.target --serve, hub vs --standalone"
	@echo "                 (or URL=http://... a running server) -> results/load.json [QUICK=1]"

$(BIN)/python:
	@if $(PY) -c "import torch" >/dev/null 2>&1; then \
		echo "venv: reusing the system torch ($$($(PY) -c 'import torch; print(torch.__version__)'))"; \
		$(PY) -m venv --system-site-packages $(VENV); \
	else \
		$(PY) -m venv $(VENV); \
	fi

$(STAMP): $(BIN)/python setup.cfg pyproject.toml
	@$(BIN)/python -c "import torch" >/dev/null 2>&1 || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[hub,edge,edge-torch,export,serve,train,bench,test,dev]"
	@touch $(STAMP)

venv install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not load" $(PYTEST_ARGS)

test-load: $(STAMP)
	$(BIN)/python -m pytest -q -m load $(PYTEST_ARGS)

hostile-probe: $(STAMP)
	$(BIN)/python scripts/hostile.py probe $(BENCH_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not load" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check starsd edge scripts tests
	$(BIN)/mypy

demo: $(STAMP)
	$(BIN)/python scripts/demo.py

models: $(STAMP)
	$(BIN)/python scripts/train_default_pair.py
	$(BIN)/python scripts/eval_models.py
	$(BIN)/python scripts/write_model_cards.py

eval-models: $(STAMP)
	$(BIN)/python scripts/eval_models.py
	$(BIN)/python scripts/write_model_cards.py

.PHONY: eagle-head
eagle-head: $(STAMP)
	$(BIN)/python scripts/train_eagle_head.py

bench: $(STAMP)
	$(BIN)/python scripts/bench.py --suite main $(BENCH_ARGS)

bench-scale: $(STAMP)
	$(BIN)/python scripts/bench.py --suite scale $(BENCH_ARGS)

bench-hubs: $(STAMP)
	$(BIN)/python scripts/bench_hubs.py $(BENCH_ARGS)

bench-service: $(STAMP)
	$(BIN)/python scripts/bench_service.py $(BENCH_ARGS)

bench-onnx: $(STAMP)
	$(BIN)/python scripts/bench_onnx.py --out results/bench-onnx.json

check-gpu: $(STAMP)
	$(BIN)/python scripts/check_gpu_backends.py --out results/gpu-backends.json

bench-lan: $(STAMP)
	$(BIN)/python scripts/bench.py --suite lan $(BENCH_ARGS)

# Without URL: starts a hub + `edge.target --serve` (then --standalone) on the default pair.
load: $(STAMP)
	$(BIN)/python scripts/load.py $(BENCH_ARGS) $(if $(URL),--url $(URL))

analytic: $(STAMP)
	$(BIN)/python -m starsd.analytic --from results/bench-scale.json --plot results/analytic.png

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
