"""What the compile check compiles: each kernel's forward and gradient at real shapes.

A case is one op at one shape, direction ("fwd": the kernel's output; "grad": the
output and the VJP of every differentiable input, so forward and backward kernels) and
dtype. Shapes are the paper's and the configs' (the ones a user runs):

  flash_ffn  370m   the paper's 370M layer, 16k tokens: B=1 L=16384 H=8 d_h=128 E=11 d_e=256
             lm     configs/lm_default.py: B=8 L=128 H=4 d_h=32 E=2 d_e=64
             seg3d  configs/seg3d_cells.py: B=8 L=3072 H=4 d_h=24 E=2 d_e=64
  flash_ffn_routed  370m, lm  the layer's op (head norm and router inside the Mosaic
             kernels, in XLA around the GPU kernels), at flash_ffn's shapes, with
             float32 tables and a norm gain as the layer passes them
  pack3d     65k    one 64x32x32 grid per entry, B=2 N=65536 H=2 D=48, traced coords
             262k   one 64^3 grid per entry, B=4 N=262144 H=2 D=48, traced coords (the
                    neighbour table, 1.7 MiB, must not have to fit TPU SMEM whole)
             262k_seg3d  the same at the segmentation width, H=4 D=24 (issue 20's D = 24 row)
             1m     one 64x128x128 grid, B=1 N=1048576 H=2 D=48, traced coords (16,384
                    cubes: every query cube's far stream walks 16,384 summaries)
             1m_seg3d  the same grid at the segmentation width, H=4 D=24
             1m_seg3d_l3  the same with 3 far-field levels (DESIGN.md section 3.1),
                    max_top_cubes = the grid's 4 x 8 x 8 level-3 cubes: 16,384 + 2,048 +
                    256 summaries per query cube's far stream
             seg3d  configs/seg3d_cells.py: B=8 N=3072 H=4 D=24, traced coords
             65k_far_offset, seg3d_far_offset  the same with a learnable far offset [H]
                    (one more operand in the kernels, one more output in the backward);
                    grad only (its forward kernel is part of it)
             seg3d_l3_far_offset  seg3d with 3 levels and per-level offsets [L, H]
  frac_scan  16k    B=1 L=16384 H=4 P=64 N=16 M=16
             lm     configs/lm_default.py: B=8 L=128 H=4 P=32 N=16 M=default(128)=12

The kernel body is the one `backend=None` picks for the target (Mosaic on TPU; Mosaic GPU for
bfloat16 FlashFFN on H100/H200, Triton for the rest of the GPU cases); a case may force one
("...@mosaic_gpu"): the Mosaic GPU bodies that are not a default yet (`OPT_IN`) are compiled
so, for the generation they serve.

`oversized` cases ask for blocks no chip can hold; the check expects them to FAIL (the
proof that a kernel that does not fit is caught).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Case:
  op: str
  shape: str
  direction: str          # "fwd" or "grad"
  dtype: str              # "float32" or "bfloat16"
  blocks: tuple = ()      # block-size overrides, (name, value) pairs
  expect_failure: bool = False
  backend: str = ""       # a forced kernel body; "" for what backend=None picks

  @property
  def name(self) -> str:
    extra = "+" + ",".join(f"{k}={v}" for k, v in self.blocks) if self.blocks else ""
    forced = f"@{self.backend}" if self.backend else ""
    return f"{self.op}/{self.shape}/{self.direction}/{self.dtype}{forced}{extra}"

  @property
  def kernel_prefix(self) -> str:
    return {"flash_ffn": "flash_ffn", "flash_ffn_routed": "flash_ffn", "pack3d": "pack3d",
            "frac_scan": "frac_scan"}[self.op]


SHAPES = {
    "flash_ffn": {"370m": dict(b=1, l=16384, h=8, d=128, e=11, f=256),
                  "lm": dict(b=8, l=128, h=4, d=32, e=2, f=64),
                  "seg3d": dict(b=8, l=3072, h=4, d=24, e=2, f=64)},
    # The layer's op: head norm and router inside the Mosaic kernels (in XLA on GPU).
    "flash_ffn_routed": {"370m": dict(b=1, l=16384, h=8, d=128, e=11, f=256),
                         "lm": dict(b=8, l=128, h=4, d=32, e=2, f=64)},
    "pack3d": {"65k": dict(b=2, grid=(64, 32, 32), h=2, d=48),
               "262k": dict(b=4, grid=(64, 64, 64), h=2, d=48),
               "262k_seg3d": dict(b=4, grid=(64, 64, 64), h=4, d=24),
               "1m": dict(b=1, grid=(64, 128, 128), h=2, d=48),
               "1m_seg3d": dict(b=1, grid=(64, 128, 128), h=4, d=24),
               "1m_seg3d_l3": dict(b=1, grid=(64, 128, 128), h=4, d=24, levels=3),
               "seg3d": dict(b=8, grid=(12, 16, 16), h=4, d=24),
               "65k_far_offset": dict(b=2, grid=(64, 32, 32), h=2, d=48, far_offset=True),
               "seg3d_far_offset": dict(b=8, grid=(12, 16, 16), h=4, d=24, far_offset=True),
               "seg3d_l3_far_offset": dict(b=8, grid=(12, 16, 16), h=4, d=24, levels=3,
                                           far_offset=True)},
    "frac_scan": {"16k": dict(b=1, l=16384, h=4, p=64, n=16, m=16),
                  "lm": dict(b=8, l=128, h=4, p=32, n=16, m=12)},
}

# Blocks far beyond any chip's on-chip memory, one per backend's limiting resource
# ("hopper", "blackwell": the Mosaic GPU kernel of that generation, which H100/H200 and B200
# compile besides the Triton one; Blackwell's tiles are at most 128 rows, so four stages of
# three [128, d_h] bf16 tables, 384 KiB, plus q, the activation operand and the router block:
# 464,964 B, 454 KiB, recorded).
OVERSIZED = {
    "tpu": Case("flash_ffn", "370m", "fwd", "float32", (("block_q", 16384),), True),
    "gpu": Case("flash_ffn", "370m", "fwd", "float32",
                (("block_q", 256), ("block_inter", 256)), True),
    "hopper": Case("flash_ffn", "370m", "fwd", "bfloat16",
                   (("block_inter", 256), ("num_stages", 4)), True, backend="mosaic_gpu"),
    "blackwell": Case("flash_ffn", "370m", "fwd", "bfloat16",
                      (("block_inter", 128), ("num_stages", 4)), True, backend="mosaic_gpu"),
}


# Kernel bodies that are not a default (measured on no chip: `dispatch.MEASURED_FASTER`),
# compiled for their generation beside the defaults, bfloat16 (what they serve): on Hopper
# FlashFFN's warp-specialized kernels (`compute_wgs=2`) at the tuned tiles and with 64-wide
# table tiles, and every shape of FRAC's and Pack3D's Mosaic GPU bodies; on Blackwell
# FlashFFN's tcgen05 body.
def _forced(ops, blocks=()) -> list[Case]:
  return [Case(op, shape, direction, "bfloat16", blocks, backend="mosaic_gpu")
          for op in ops for shape, sizes in SHAPES[op].items()
          for direction in (("grad",) if sizes.get("far_offset") else ("fwd", "grad"))]


OPT_IN = {
    "hopper": [Case("flash_ffn", "370m", direction, "bfloat16", blocks, backend="mosaic_gpu")
               for direction in ("fwd", "grad")
               for blocks in ((("compute_wgs", 2),),
                              (("block_inter", 64), ("compute_wgs", 2)))]
              + _forced(("pack3d", "frac_scan")),
    "blackwell": _forced(("flash_ffn", "flash_ffn_routed")),
}


# What CI compiles on every change (`make compile-check-ci`): everything `all_cases` gives but
# four Pack3D grids and the 1M-token grids in float32. 65k, 262k and 262k_seg3d compile the
# tile plans of the 1M-token grid of their width at fewer tokens (scoped VMEM within 2%,
# results.json); 1m_seg3d's one-level D = 24 kernel is compiled at the seg3d shapes, and each
# width's float32 kernels at the config and far-offset shapes. Pack3D is 83% of the full
# check's compile time; the full check (`make compile-check`) still compiles each.
CI_SKIPPED_SHAPES = {"pack3d": {"65k", "262k", "262k_seg3d", "1m_seg3d"}}
CI_BFLOAT16_ONLY = {"pack3d": {"1m", "1m_seg3d_l3"}}


def ci_cases(cases: list[Case]) -> list[Case]:
  """The subset of `cases` CI compiles (see `CI_SKIPPED_SHAPES`)."""
  return [c for c in cases
          if c.shape not in CI_SKIPPED_SHAPES.get(c.op, ())
          and (c.dtype == "bfloat16" or c.shape not in CI_BFLOAT16_ONLY.get(c.op, ()))]


def parse(name: str) -> Case:
  """The inverse of `Case.name` ("op/shape/direction/dtype[@backend][+block=value,...]")."""
  base, _, extra = name.partition("+")
  base, _, backend = base.partition("@")
  op, shape, direction, dtype = base.split("/")
  blocks = tuple((k, int(v)) for k, v in (kv.split("=") for kv in extra.split(",") if kv))
  expect_failure = any(c.name == name and c.expect_failure for c in OVERSIZED.values())
  return Case(op, shape, direction, dtype, blocks, expect_failure, backend)


def all_cases(kind: str, ops=None, shapes=None, generation: str = "") -> list[Case]:
  """Every shape x direction x dtype of the given ops (far-offset shapes: grad only), plus the
  target kind's oversized case (and the Mosaic GPU one of the target's `generation`,
  "hopper" or "blackwell", `Target.generation`) and the generation's opt-in bodies (`OPT_IN`)
  when their op is among `ops`. `shapes` (a set of shape names, None: all) selects shapes and
  leaves the oversized and opt-in cases out."""
  cases = [Case(op, shape, direction, dtype)
           for op, op_shapes in SHAPES.items() if ops is None or op in ops
           for shape, sizes in op_shapes.items() if shapes is None or shape in shapes
           for direction in (("grad",) if sizes.get("far_offset") else ("fwd", "grad"))
           for dtype in ("float32", "bfloat16")]
  oversized = [OVERSIZED[kind]] + ([OVERSIZED[generation]] if generation else [])
  if shapes is not None:
    return cases
  opt_in = OPT_IN.get(generation, [])
  return cases + [c for c in opt_in + oversized if ops is None or c.op in ops]


def build(case: Case, kind: str):
  """(fn, [(shape, dtype), ...]): the jittable function and its argument specs.

  A forced backend, or block-size overrides (which go to the target kind's Triton or Mosaic
  body: with backend=None every platform branch is traced, and a Triton tile need not suit
  Mosaic), compile that kernel body with interpret=False."""
  import jax
  import jax.numpy as jnp

  dtype = jnp.dtype(case.dtype)
  blocks = dict(case.blocks)
  if blocks or case.backend:
    blocks["backend"] = case.backend or {"tpu": "mosaic", "gpu": "triton"}[kind]
    blocks["interpret"] = False
  s = SHAPES[case.op][case.shape]
  if case.op == "flash_ffn":
    from neurips26_jax.pallas_kernels.flash_ffn import mhffn
    table = (s["h"], s["e"], s["f"], s["d"])
    specs = [((s["b"], s["l"], s["h"], s["d"]), dtype), ((s["b"], s["l"], s["h"], s["e"]), dtype),
             (table, dtype), (table, dtype), (table, dtype)]
    op, num_diff = (lambda *a: mhffn(*a, **blocks)), 5
  elif case.op == "flash_ffn_routed":
    from neurips26_jax.pallas_kernels.flash_ffn import mhffn_routed
    table = (s["h"], s["e"], s["f"], s["d"])
    # As the layer calls it: the float32 tables and the norm gain as stored.
    specs = [((s["b"], s["l"], s["h"], s["d"]), dtype), ((s["h"], s["d"], s["e"]), jnp.float32),
             (table, jnp.float32), (table, jnp.float32), (table, jnp.float32),
             ((s["h"], s["d"]), jnp.float32)]
    op, num_diff = (lambda q, w_r, k, u, v, g: mhffn_routed(q, w_r, k, u, v, gain=g,
                                                            **blocks)), 6
  elif case.op == "pack3d":
    from neurips26_jax.pallas_kernels.pack3d_attention import pack3d_attention
    n = math.prod(s["grid"])
    x = ((s["b"], n, s["h"], s["d"]), dtype)
    levels = s.get("levels", 1)
    beta = (s["h"],) if levels == 1 else (levels, s["h"])  # with levels: per level
    offset = [(beta, jnp.float32)] if s.get("far_offset") else []
    specs = [x, x, x, *offset, ((s["b"], n, 3), jnp.int32), ((s["b"], n), jnp.int32)]
    cubes = math.prod(-(-g // 4) for g in s["grid"])
    num_diff = 3 + len(offset)
    if levels > 1:  # the top level's slots: the grid's level-L cubes (4 * 2^(L-1) per axis)
      blocks.update(levels=levels, max_top_cubes=math.prod(
          -(-g // (4 * 2 ** (levels - 1))) for g in s["grid"]))

    def op(*args):
      q, k, v, *beta = args[:num_diff]
      return pack3d_attention(q, k, v, *args[num_diff:], max_cubes=cubes,
                              far_offset=beta[0] if beta else None, **blocks)
  else:
    from neurips26_jax.pallas_kernels.frac_scan import frac_scan
    tok = (s["b"], s["l"], s["h"])
    specs = [(tok + (s["p"],), dtype), (tok, jnp.float32), (tok + (s["n"],), dtype),
             (tok + (s["n"],), dtype), ((s["h"], s["m"]), jnp.float32),
             ((s["h"], s["m"]), jnp.float32)]
    op, num_diff = (lambda *a: frac_scan(*a, **blocks)[0]), 6

  if case.direction == "fwd":
    return op, specs

  def grad(*args):
    diff, rest = args[:num_diff], args[num_diff:]
    out, vjp = jax.vjp(lambda *d: op(*d, *rest), *diff)
    return out, vjp(out)

  return grad, specs
