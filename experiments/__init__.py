"""Controlled CPU-scale experiments behind RESULTS.md, one runner module each.

  python -m experiments.lm_shakespeare --config=configs/exp_lm_shakespeare.py
  python -m experiments.frac_memory    --config=configs/exp_frac_memory.py
  python -m experiments.repacking      --config=configs/exp_repacking.py
  python -m experiments.seg3d_cpu      --config=configs/exp_seg3d_cpu.py

Each writes results/<name>.json after every finished arm (a re-run skips finished arms and
resumes an unfinished one from its checkpoint) and results/<name>.png.
"""
