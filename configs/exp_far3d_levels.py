"""The multi-level far field on the far-context task: does `levels=2` learn as well as the
paper's single level where the marker lies beyond a query's level-2 neighbourhood?

  python -m experiments.repacking --config=configs/exp_far3d_levels.py
  python -m experiments.repacking --config=configs/exp_far3d_levels.py:sweep --seeds=0
  python -m experiments.repacking --config=configs/exp_far3d_levels.py:long --seeds=0

The task of configs/exp_far3d.py (an object's class is decided by a cube-sized marker two or
more cubes away, its surface flag by the exact local neighbourhood) on one 16^3 field per
4096-token item (cubes of 2^3: 8^3 cubes per field; level-2 cubes of 4^3 tokens: 4^3 per
field), batch 2, so a step holds the tokens of configs/exp_far3d.py's batch of 8. With
radius 1 at both levels a query reads level-1 summaries within its level-2 neighbourhood
(3^3 level-2 cubes) and level-2 summaries beyond: most objects see the marker only through a
level-2 summary (the mean of 8 cubes, one of them the marker's). Arms: the single level (the
default), two levels with the counting-exact summaries (`levels2`: level_key_gain 1, as
first measured), two levels with the level-2 keys scaled by 8 (`levels2_gain8`, the default
gain since: does undoing the marker's 8-fold dilution in the level-2 logits let two levels
learn it?), and the local branch alone (the floor: no far context). Unseen shapes: other
fields of 4096 tokens or fewer, each with at least 3 cubes per axis. The batches'
coordinates are traced, so the two-level arm bounds its top level by `max_top_cubes` = 128
(the largest field here has 5 x 4 x 4 = 80 level-2 cubes), not by the 1024 level-1 slots.
The `sweep` variant (its own results file, far3d_levels_sweep) runs `levels2` at the two
other learning rates of configs/exp_far3d.py's sweep, 1e-3 and 4e-3: is 2e-3 what holds it back?
The `long` variant (far3d_levels_long) trains `levels2`, then the single level, three times as
long (1200 steps, the cosine decay over 1200 steps after the same 40 warm-up steps): does
levels2 learn the far part later, or not at all? (At 400 steps the single level learned it on
2 of 3 seeds.)
"""

from neurips26_jax.configs import exp_far3d


def get_config(variant: str = "main"):
  if variant not in ("main", "sweep", "long"):
    raise ValueError(f"exp_far3d_levels: variant must be 'main', 'sweep' or 'long', got "
                     f"{variant!r}")
  c = exp_far3d.get_config()
  c.batch_size = 2
  c.data.update({"shapes": [(16, 16, 16)], "fields_per_item": 1, "num_tokens": 4096,
                 "eval_shapes": [(12, 16, 20), (16, 12, 12), (20, 14, 14), (8, 24, 16)]})
  c.model.attention_options.max_cubes = 1024
  c.experiment.update({
      "name": "far3d_levels",
      "lrs": (2e-3,),
      "order": ("axial_rope", "levels2", "levels2_gain8", "local_only"),
      "arms": {"axial_rope": {"position": "axial_rope"},
               "levels2": {"position": "axial_rope", "levels": 2, "max_top_cubes": 128,
                           "level_key_gain": 1.0},
               "levels2_gain8": {"position": "axial_rope", "levels": 2, "max_top_cubes": 128,
                                 "level_key_gain": 8.0},
               "local_only": {"position": "axial_rope", "merge": "local"}},
  })
  if variant == "sweep":
    c.experiment.update({"name": "far3d_levels_sweep", "lrs": (1e-3, 4e-3),
                         "order": ("levels2",)})
  if variant == "long":
    c.steps = 3 * c.steps
    c.experiment.update({"name": "far3d_levels_long", "order": ("levels2", "axial_rope")})
  return c
