# Two commands from a fresh clone: `make test` and `make demo`. Both create .venv first.
# Two ends of the supported range, each an exact set of versions in constraints/:
#   default  .venv         Python 3.12, jax 0.12.0.1  constraints/py312-jax012.txt
#   lowest   .venv-lowest  Python 3.11, jax 0.10.2    constraints/py311-jax010.txt  (make test-lowest)
# tools/venv.sh finds the Python (PYTHON=... overrides), rebuilds a venv made by another
# Python and reinstalls when pyproject.toml or the constraints change.
VENV := .venv
PY := $(VENV)/bin/python
CONSTRAINTS := constraints/py312-jax012.txt
LOWEST_CONSTRAINTS := constraints/py311-jax010.txt

.PHONY: setup setup-lowest test test-lowest test-slow mutants demo docs bench clean aot-setup \
        compile-check compile-check-tpu compile-check-ci compile-check-gpu memory-aot lock perf-tpu \
        perf-tpu-sweep sass sass-setup scale-check

setup:
	@tools/venv.sh $(VENV) 3.12 $(CONSTRAINTS) dev,docs

setup-lowest:
	@PYTHON=$(PYTHON_LOWEST) tools/venv.sh .venv-lowest 3.11 $(LOWEST_CONSTRAINTS) dev

# Two workers, whole files each (a file's tests share their compiled functions and fixtures);
# the 15 slowest tests are named at the end (the suite's budget: 10 min on 2 cores).
test: setup
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n 2 --dist loadfile --durations=15

# The same suite at the low end of the ranges in pyproject.toml.
test-lowest: setup-lowest
	JAX_PLATFORMS=cpu .venv-lowest/bin/python -m pytest -q -n 2 --dist loadfile --durations=15

test-slow: setup
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -m slow

# Deliberate small bugs, each applied to a temporary copy of the tree with the tests that must
# catch it (tools/mutants.py); a survivor is a blind spot. ~15-30 min on 2 cores.
mutants: setup
	JAX_PLATFORMS=cpu $(PY) -m tools.mutants

# One fixed workdir, so that rerunning `make demo` resumes an interrupted demo (a finished one
# says so and trains nothing); `make demo DEMO_DIR=runs/demo2` starts another.
DEMO_DIR ?= runs/demo
demo: setup
	JAX_PLATFORMS=cpu $(PY) -m neurips26_jax.train.train_lm --config=lm_default --workdir=$(DEMO_DIR)

# The documentation site into build/site (docs/; open build/site/index.html). Strict: a
# warning, a broken cross-reference or a public symbol missing from the API reference fails.
docs: setup
	JAX_PLATFORMS=cpu $(PY) -m sphinx -E -W --keep-going -q -b html docs build/site

bench: setup
	JAX_PLATFORMS=cpu $(PY) -m benchmarks.flash_ffn_memory
	JAX_PLATFORMS=cpu $(PY) -m benchmarks.pack3d_speed
	JAX_PLATFORMS=cpu $(PY) -m benchmarks.frac_speed

# Deviceless AOT compiles for real chips (benchmarks/aot): the TPU compiler (libtpu) and the
# CUDA plugin with ptxas live in their own venvs, from the aot extras at the default end.
AOT_TPU := .venv-aot-tpu/.installed
AOT_GPU := .venv-aot-gpu/.installed

.venv-aot-%/.installed: FORCE
	@tools/venv.sh .venv-aot-$* 3.12 $(CONSTRAINTS) aot-$*

aot-setup: $(AOT_TPU) $(AOT_GPU)

# Every kernel, fwd and grad, f32 and bf16, for TPU v5e/v6e and GPU A100/H100/H200/B200; rewrites
# the table in benchmarks/README.md. Fails if a kernel does not compile, spills > 1 KiB or
# takes > 60 s, or if a deliberately oversized block is not refused.
compile-check: setup aot-setup
	$(PY) -m benchmarks.aot.check --readme

# The TPU half alone (the GPU half is `make compile-check-gpu`).
compile-check-tpu: setup $(AOT_TPU)
	$(PY) -m benchmarks.aot.check --targets=tpu-v5e,tpu-v6e --out=benchmarks/aot/results-tpu

# What CI compiles (.ci/run): the TPU half without the Pack3D grids that compile the same tile
# plans at fewer tokens (benchmarks/aot/cases.py, `ci_cases`); results go to build/, so the
# recorded tables stay those of the full runs.
compile-check-ci: setup $(AOT_TPU)
	@mkdir -p build
	$(PY) -m benchmarks.aot.check --ci --targets=tpu-v5e,tpu-v6e --out=build/compile-check-ci

# The GPU half alone (what backend=None runs: H100/H200 Mosaic GPU for FlashFFN bf16, Triton
# for the rest; plus the opt-in Mosaic GPU bodies of `cases.OPT_IN`), its rows merged into the
# table with the TPU rows of the last full run.
compile-check-gpu: setup $(AOT_GPU)
	$(PY) -m benchmarks.aot.check --targets=gpu-a100,gpu-h100,gpu-h200,gpu-b200 --merge --readme

# What the Mosaic GPU kernels compile to on Hopper, without a GPU: per main-loop iteration
# HGMMA shapes, waits, shared-memory stores and fences, MUFU ops, spills; registers, CTAs
# per SM and waves (benchmarks/aot/sass.py; ~1 min); rewrites the table in benchmarks/README.md.
# nvdisasm comes from NVIDIA's wheel, installed beside (not into) the GPU venv's packages:
# jax would take that wheel's nvidia.cu13 folder, which has no ptxas, for its CUDA root.
NVDISASM := nvidia-cuda-nvdisasm==13.5.37
sass-setup: $(AOT_GPU)
	@test -x .venv-aot-gpu/nvdisasm/nvidia/cu13/bin/nvdisasm || .venv-aot-gpu/bin/pip install \
	  --quiet --no-deps --target .venv-aot-gpu/nvdisasm $(NVDISASM)

sass: setup sass-setup
	$(PY) -m benchmarks.aot.sass --readme

# TPU speed without a TPU: libtpu's static cycle estimate of each kernel beside the XLA
# program it replaces, v5e and v6e (benchmarks/aot/perf.py; ~1-2 h on 2 cores, not in CI);
# rewrites the table in benchmarks/README.md. perf-tpu-sweep: FlashFFN's block sizes per
# chip and dtype (benchmarks/aot/perf_sweep.json; blocks.TUNED holds its picks).
perf-tpu: setup $(AOT_TPU)
	$(PY) -m benchmarks.aot.perf --readme

perf-tpu-sweep: setup $(AOT_TPU)
	$(PY) -m benchmarks.aot.perf --sweep

# The paper-size language models' whole sharded train step, compiled deviceless for a v5e-16
# (benchmarks/aot/scale.py): each size as attention + SwiGLU and FRAC + FlashFFN must fit the
# chips' HBM with 10% headroom. ~15-30 min on 2 cores; not in CI.
SCALE_SIZES := 125m 370m 1.3b
scale-check: setup $(AOT_TPU)
	@for size in $(SCALE_SIZES); do for arm in "attention swiglu" "frac flashffn"; do \
	  set -- $$arm; echo "== lm_paper:$$size $$1 + $$2"; \
	  PYTHONPATH=. .venv-aot-tpu/bin/python -m benchmarks.aot.scale --config=lm_paper:$$size \
	    --mixer=$$1 --ffn=$$2 || exit 1; done; done

# FlashFFN vs SwiGLU fwd+bwd memory from the TPU and GPU compilers' memory analysis.
memory-aot: aot-setup
	PYTHONPATH=. .venv-aot-tpu/bin/python -m benchmarks.aot.memory --target=tpu-v5e
	PYTHONPATH=. .venv-aot-gpu/bin/python -m benchmarks.aot.memory --target=gpu-h100

clean:
	rm -rf $(VENV) .venv-lowest .venv-aot-tpu .venv-aot-gpu .pytest_cache

# Rewrites both constraints files from pyproject.toml's ranges (newest on 3.12, lower bounds
# on 3.11); run after changing a range, then `make test test-lowest`.
lock:
	py312=$$(tools/venv.sh --find 3.12) && py311=$$(PYTHON=$(PYTHON_LOWEST) tools/venv.sh --find 3.11) \
	  && $$py312 tools/lock.py --python=$$py312 --out=$(CONSTRAINTS) \
	  && $$py312 tools/lock.py --lowest --python=$$py311 --out=$(LOWEST_CONSTRAINTS)

FORCE:

# The evidence in RESULTS.md: every arm of the four CPU-scale experiments, hours on
# 2 cores; each runner resumes (results/<name>.json, runs/experiments/) and skips finished arms.
.PHONY: experiments
experiments: setup
	JAX_PLATFORMS=cpu $(PY) -m experiments.lm_shakespeare --config=configs/exp_lm_shakespeare.py
	JAX_PLATFORMS=cpu $(PY) -m experiments.frac_memory --config=configs/exp_frac_memory.py
	JAX_PLATFORMS=cpu $(PY) -m experiments.repacking --config=configs/exp_repacking.py
	JAX_PLATFORMS=cpu $(PY) -m experiments.seg3d_cpu --config=configs/exp_seg3d_cpu.py
	$(PY) -m experiments.report > results/tables.md
