# Two commands do all set-up on a fresh machine:  make demo   and   make test
# Both create .venv on first use and are safe to re-run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# PyTorch first, pinned, so the requirements' range installs nothing more (a bare `torch` would pull CUDA wheels).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# No allocator environment: pretrain_gpt.py sets its own CPU allocator policy at start-up
# (megalite/train/allocator.py), and tests/conftest.py and the memory benchmark set the same one, so the
# tests, the benchmarks and a user's bare command see the same memory.

.PHONY: demo test test-slow test-cuda setup bench clean-demo

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	PY=$(PY) bash examples/demo.sh

# the default suite; the long runs (marked slow) with: make test-slow.
# Two pytest workers, whole test files each (so a module's fixtures run once): one worker leaves a core
# idle while its launches start up or wait. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	WANDB_MODE=offline $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not cuda" tests

test-slow: $(STAMP)
	WANDB_MODE=offline $(PY) -m pytest -q -m slow tests

# the CUDA tier (tests/cuda): one GPU, NCCL at world size 1, --compile; with 2+ GPUs, TP/PP/DP/CP equivalence
# over NCCL at world 2/4/8 (each world size where that many GPUs are visible); skipped where torch sees no GPU.
# (PyPI's Linux torch wheel, which setup installs, is a CUDA build.)
test-cuda: $(STAMP)
	WANDB_MODE=offline $(PY) -m pytest -q -m cuda tests/cuda

# Every benchmark, written to bench/RESULTS.md (bench/run_all.py); BENCH_ARGS=--quick for a smoke test
# written to bench/quick/RESULTS.md instead.
bench: $(STAMP)
	$(PY) bench/run_all.py $(BENCH_ARGS)

clean-demo:
	rm -rf data/stdlib* data/cache runs/demo
