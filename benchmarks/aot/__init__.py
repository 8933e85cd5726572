"""Deviceless ahead-of-time compiles of every Pallas kernel for real TPUs and GPUs.

`jax.export` only lowers a kernel; these modules run the backend compilers themselves
(libtpu's Mosaic compiler for TPU v5e / v6e; XLA's Triton pipeline and ptxas for NVIDIA
A100 / H100 / H200) on a CPU-only machine, from a topology description of the chip.

  targets.py  the five targets: how to describe each chip and its limits
  cases.py    what is compiled: each op's forward and gradient at real shapes
  worker.py   compiles cases for one target (runs inside that target's venv)
  report.py   parses the compilers' own reports (ptxas -v, XLA dumps)
  check.py    the driver: `make compile-check` -> table in benchmarks/README.md
"""
