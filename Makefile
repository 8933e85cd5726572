# Two commands from a fresh clone: `make test` and `make demo`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-slow mutants demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==26.3
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: setup
	JAX_PLATFORMS=cpu $(PY) -m pytest -q

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

clean:
	rm -rf $(VENV) .pytest_cache

# Issue 12's evidence (RESULTS.md): every arm of the four CPU-scale experiments, hours on
# 2 cores; each runner resumes (results/<name>.json, runs/experiments/) and skips finished arms.
.PHONY: experiments
experiments: setup
	JAX_PLATFORMS=cpu $(PY) -m experiments.lm_shakespeare --config=configs/exp_lm_shakespeare.py
	JAX_PLATFORMS=cpu $(PY) -m experiments.frac_memory --config=configs/exp_frac_memory.py
	JAX_PLATFORMS=cpu $(PY) -m experiments.repacking --config=configs/exp_repacking.py
	JAX_PLATFORMS=cpu $(PY) -m experiments.seg3d_cpu --config=configs/exp_seg3d_cpu.py
	$(PY) -m experiments.report > results/tables.md
