"""Far context in 3D: the geometry task with a cube-sized marker, so a token's class needs the
far branch (its marker is two or more cubes away) and its surface flag the exact local
neighbourhood.

  python -m experiments.repacking --config=configs/exp_far3d.py

Fields of 8x8x8 tokens in cubes of 2x2x2 (4x4x4 cubes), two per packed sequence of 1024, radius
1: the marker cube is never in an object token's local neighbourhood. Arms (Pack3DAttention
options over the config's): Pack3D with axial RoPE (the default), learned positions of the
packed index, no positions, the local branch alone (merge="local"), the learnable per-head far
offset, and dense attention within each field (radius 3 covers the whole 4x4x4-cube field, so
nothing is far): the arm that shows the far part is learnable within the step cap. Every arm
is swept over three learning rates at seed 0 and run at its best for seeds 1, 2; every joint
arm is also evaluated with its far branch off (`far_off` in the json).
"""

import ml_collections

from neurips26_jax.configs import exp_repacking


def get_config():
  c = exp_repacking.get_config()
  c.steps = 400
  c.data.marker = "cube"
  c.experiment = ml_collections.ConfigDict({
      "name": "far3d",
      "seeds": (0, 1, 2),
      "lrs": (1e-3, 2e-3, 4e-3),
      "order": ("axial_rope", "dense", "local_only", "learned_packed", "none", "far_offset"),
      "arms": {"axial_rope": {"position": "axial_rope"},
               "dense": {"position": "axial_rope", "radius_blocks": 3},
               "local_only": {"position": "axial_rope", "merge": "local"},
               "learned_packed": {"position": "learned_packed"},
               "none": {"position": "none"},
               "far_offset": {"position": "axial_rope", "far_offset": True}},
      "eval_batches": 8,
  })
  return c
