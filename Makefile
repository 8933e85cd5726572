# Two commands from a fresh clone: `make test` and `make demo`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-slow mutants demo bench clean aot-setup compile-check compile-check-tpu memory-aot

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==26.3
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Two workers, whole files each (a file's tests share their compiled functions and fixtures).
test: setup
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n 2 --dist loadfile

test-slow: setup
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -m slow

# Deliberate small bugs, each applied to a temporary copy of the tree with the tests that must
# catch it (tools/mutants.py); a survivor is a blind spot. ~15-30 min on 2 cores.
mutants: setup
	JAX_PLATFORMS=cpu $(PY) -m tools.mutants

demo: setup
	JAX_PLATFORMS=cpu $(PY) -m train.train_lm --config=configs/lm_default.py --workdir=runs/demo-$$(date +%Y%m%d-%H%M%S)

bench: setup
	JAX_PLATFORMS=cpu $(PY) -m benchmarks.flash_ffn_memory
	JAX_PLATFORMS=cpu $(PY) -m benchmarks.pack3d_speed
	JAX_PLATFORMS=cpu $(PY) -m benchmarks.frac_speed

# Deviceless AOT compiles for real chips (benchmarks/aot): the TPU compiler (libtpu) and the
# CUDA plugin with ptxas live in their own venvs, from the pinned extras in pyproject.toml.
AOT_TPU := .venv-aot-tpu/.installed
AOT_GPU := .venv-aot-gpu/.installed

$(AOT_TPU) $(AOT_GPU): .venv-aot-%/.installed: pyproject.toml
	test -x .venv-aot-$*/bin/python || $(PYTHON) -m venv .venv-aot-$*
	.venv-aot-$*/bin/python -m pip install --quiet --upgrade pip==26.3
	.venv-aot-$*/bin/python -m pip install --quiet -e '.[aot-$*]'
	touch $@

aot-setup: $(AOT_TPU) $(AOT_GPU)

# Every kernel, fwd and grad, f32 and bf16, for TPU v5e/v6e and GPU A100/H100/H200; rewrites
# the table in benchmarks/README.md. Fails if a kernel does not compile, spills > 1 KiB or
# takes > 60 s, or if a deliberately oversized block is not refused.
compile-check: setup aot-setup
	$(PY) -m benchmarks.aot.check --readme

# The TPU half alone (what CI runs after the tests; the GPU half is `make compile-check`).
compile-check-tpu: setup $(AOT_TPU)
	$(PY) -m benchmarks.aot.check --targets=tpu-v5e,tpu-v6e --out=benchmarks/aot/results-tpu

# FlashFFN vs SwiGLU fwd+bwd memory from the TPU and GPU compilers' memory analysis.
memory-aot: aot-setup
	PYTHONPATH=. .venv-aot-tpu/bin/python -m benchmarks.aot.memory --target=tpu-v5e
	PYTHONPATH=. .venv-aot-gpu/bin/python -m benchmarks.aot.memory --target=gpu-h100

clean:
	rm -rf $(VENV) .venv-aot-tpu .venv-aot-gpu .pytest_cache

# Issue 12's evidence (RESULTS.md): every arm of the four CPU-scale experiments, hours on
# 2 cores; each runner resumes (results/<name>.json, runs/experiments/) and skips finished arms.
.PHONY: experiments
experiments: setup
	JAX_PLATFORMS=cpu $(PY) -m experiments.lm_shakespeare --config=configs/exp_lm_shakespeare.py
	JAX_PLATFORMS=cpu $(PY) -m experiments.frac_memory --config=configs/exp_frac_memory.py
	JAX_PLATFORMS=cpu $(PY) -m experiments.repacking --config=configs/exp_repacking.py
	JAX_PLATFORMS=cpu $(PY) -m experiments.seg3d_cpu --config=configs/exp_seg3d_cpu.py
	$(PY) -m experiments.report > results/tables.md
