# Two commands for a newcomer: `make demo` and `make test`. Both create .venv when it is missing.
# torch is pinned to the local CPU wheel so nothing here ever pulls CUDA wheels.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
NPROC  ?= 2

.PHONY: gpu-check venv test test-fast demo bench clean docs lint

$(VENV)/.installed: setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]" "$(TORCH)"
	touch $@

venv: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m ruff check .
	TRITON_INTERPRET=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(NPROC) --durations=15 tests

# ruff (pyflakes, pycodestyle; config in pyproject.toml): make test runs it first
lint: $(VENV)/.installed
	$(PY) -m ruff check .

# The docs site (MkDocs Material + mkdocstrings): --strict fails on a broken link or a page missing from the nav
docs: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

demo: $(VENV)/.installed
	OMP_NUM_THREADS=1 ACCELERATE_USE_CPU=1 $(VENV)/bin/accelerate launch --multi_gpu --num_processes 4 \
		--num_machines 1 --mixed_precision no --dynamo_backend no \
		examples/train_clm.py --tp 2 --steps 300 --seq-len 32 --batch-size 8 --output demo_out

bench: $(VENV)/.installed
	$(PY) benchmarks/load_memory.py

# On a machine with a CUDA GPU and its own torch (no venv): the zoo against transformers on the GPU (NCCL, Triton),
# the fused-op tests on CUDA, the GPU benchmarks; logs and JSON under $$OUT (default /tmp/gpu_session).
gpu-check:
	bash benchmarks/gpu_session.sh

clean:
	rm -rf demo_out site build dist *.egg-info .pytest_cache
