# Two commands do all set-up on a fresh machine:  make demo   and   make test
# Both create .venv on first use and are safe to re-run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# PyTorch first, pinned, so the requirements' range installs nothing more (a bare `torch` would pull CUDA wheels).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# CPU runs preload jemalloc where it is installed (Debian: libjemalloc2) with the MALLOC_CONF that
# torch.backends.xeon.run_cpu --enable-jemalloc sets: freed pages are purged on a background thread, so peak
# RSS follows what is alive, as the tests that bound it against theory need (each step then faults its
# freed activations back in: bench/RESULTS.md, "CPU allocator"). Without jemalloc, glibc's malloc runs with
# a fixed 1 MiB mmap threshold, so a freed block of 1 MiB or more goes back to the OS: glibc's adaptive
# threshold would keep such blocks in a heap that never shrinks, and those tests fail.
JEMALLOC ?= $(shell ldconfig -p 2>/dev/null | grep -o '/[^ ]*libjemalloc\.so\.2' | head -1)
JEMALLOC_CONF ?= oversize_threshold:1,background_thread:true,metadata_thp:auto
RUN_ENV := $(if $(JEMALLOC),LD_PRELOAD=$(JEMALLOC) MALLOC_CONF=$(JEMALLOC_CONF),GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1048576)

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
	$(RUN_ENV) PY=$(PY) bash examples/demo.sh

# the default suite; the long runs (marked slow) with: make test-slow.
# Two pytest workers, whole test files each (so a module's fixtures run once): one worker leaves a core
# idle while its launches start up or wait. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(RUN_ENV) WANDB_MODE=offline $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not cuda" tests

test-slow: $(STAMP)
	$(RUN_ENV) WANDB_MODE=offline $(PY) -m pytest -q -m slow tests

# the CUDA tier (tests/cuda): one GPU, NCCL at world size 1, --compile; with 2+ GPUs, TP/PP/DP/CP equivalence
# over NCCL at world 2/4/8 (each world size where that many GPUs are visible); skipped where torch sees no GPU.
# (PyPI's Linux torch wheel, which setup installs, is a CUDA build.)
test-cuda: $(STAMP)
	$(RUN_ENV) WANDB_MODE=offline $(PY) -m pytest -q -m cuda tests/cuda

# Every benchmark, written to bench/RESULTS.md (bench/run_all.py); BENCH_ARGS=--quick for a smoke test
# written to bench/quick/RESULTS.md instead.
bench: $(STAMP)
	$(RUN_ENV) $(PY) bench/run_all.py $(BENCH_ARGS)

clean-demo:
	rm -rf data/stdlib* data/cache runs/demo
