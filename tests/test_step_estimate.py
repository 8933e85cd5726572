"""benchmarks/aot/step_estimate.py: a train step as the sum of its single-chip parts, on made-up
part estimates (no compile): the arithmetic of compute (a block from its halves' forwards and
backwards under remat), AdamW, the collectives model, MFU, and the FLOP-floor check."""

import math

import pytest

from benchmarks.aot import perf, step_estimate

SPEC = dict(config="configs/lm_paper.py:125m", mixer="attention", ffn="swiglu", batch=1,
            context=None, remat="full")


def test_the_papers_configs_keep_the_mixers_core():
  """configs/lm_paper.py rematerialises with "mixer" (the shorter step that fits at 4k)."""
  assert step_estimate.model_facts(dict(SPEC, remat=None))["remat"] == "mixer"


def test_step_is_the_sum_of_its_parts():
  chip = perf.CHIPS["tpu-v5e"]
  facts = step_estimate.model_facts(SPEC)
  assert facts["layers"] == 12 and facts["context"] == 4096
  assert 0.98 * 135e6 < facts["params"] < 1.02 * 135e6
  assert facts["remat"] == "full" and facts["heads"] == 12
  cycles = {"mixer/fwd": 500_000, "mixer/bwd": 900_000, "ffn/fwd": 300_000,
            "ffn/bwd": 700_000, "head": 1_500_000}
  parts = {k: dict(status="ok", cycles=c, flops=1e9) for k, c in cycles.items()}
  assert set(parts) == set(step_estimate.PARTS)
  row = step_estimate.estimate(SPEC, "tpu-v5e", 16, parts)
  # per half: the forward twice (remat recomputes it) and the backward once
  block = 2 * 500_000 + 900_000 + 2 * 300_000 + 700_000
  assert row["block_ms"] == pytest.approx(block / chip.clock_hz * 1e3)
  assert row["ffn_ms"] == pytest.approx((2 * 300_000 + 700_000) / chip.clock_hz * 1e3)
  compute = (12 * block + 1_500_000) / chip.clock_hz
  optimizer = 28 * facts["params"] / 16 / chip.hbm_bytes_per_s
  collectives = 12 * facts["params"] * 15 / 16 / (1600e9 / 8)
  assert row["compute_ms"] == pytest.approx(compute * 1e3)
  assert row["optimizer_ms"] == pytest.approx(optimizer * 1e3)
  assert row["collectives_ms"] == pytest.approx(collectives * 1e3)
  low, high = compute + optimizer, compute + optimizer + collectives
  assert row["step_ms"] == pytest.approx((low * 1e3, high * 1e3))
  peak = chip.clock_hz * chip.flops_per_cycle
  assert row["mfu"] == pytest.approx((6 * facts["params"] * 4096 / (peak * high),
                                      6 * facts["params"] * 4096 / (peak * low)))
  assert row["tokens_per_s_per_chip"] == pytest.approx((4096 / high, 4096 / low))
  assert row["untrusted"] == []


def test_a_part_faster_than_its_flop_floor_is_flagged():
  chip = perf.CHIPS["tpu-v5e"]
  floor_cycles = 1e12 / chip.flops_per_cycle
  parts = {k: dict(status="ok", cycles=floor_cycles, flops=1e12) for k in step_estimate.PARTS}
  parts["ffn/bwd"]["cycles"] = floor_cycles / 2
  row = step_estimate.estimate(SPEC, "tpu-v5e", 16, parts)
  assert len(row["untrusted"]) == 1 and row["untrusted"][0].startswith("ffn/bwd")
  assert "untrusted: ffn/bwd" in step_estimate.line(dict(row, context=4096))


def test_a_failed_part_is_the_rows_error():
  parts = {k: dict(status="ok", cycles=1, flops=1) for k in step_estimate.PARTS}
  parts["mixer/bwd"] = dict(status="crashed", error="libtpu aborted")
  row = step_estimate.estimate(SPEC, "tpu-v5e", 16, parts)
  assert row["error"].startswith("mixer/bwd: crashed: libtpu aborted")


def test_the_profiled_log_gamma_matches_jax():
  """The gather-free log-gamma the FRAC step parts are profiled with (perf_programs) is jax's
  on the exponents FRAC takes it of, alpha and alpha + 1 in (0, 2]."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from benchmarks.aot.perf_programs import _stirling_gammaln
  x = jnp.linspace(0.01, 2.0, 500, dtype=jnp.float32)
  np.testing.assert_allclose(_stirling_gammaln(x), jax.scipy.special.gammaln(x), atol=3e-6)


def test_a_frac_mixers_forward_is_its_three_programs():
  """A FRAC mixer's forward: the half up to the scan, the scan op at the layer's shape with
  its heads in pieces (each piece counted), the half from the scan's output; remat counts
  their sum twice."""
  chip = perf.CHIPS["tpu-v5e"]
  spec = dict(SPEC, mixer="frac")
  programs = step_estimate.part_programs(spec)
  assert "mixer/fwd" not in programs
  name, direction, overrides, times = programs["mixer/fwd:scan"]
  assert (name, direction, times) == ("frac/kernel", "fwd", 3)
  assert overrides["shape"] == dict(b=1, l=4096, h=4, p=64, n=16, m=16)
  assert {programs[p][0] for p in ("mixer/fwd:pre", "mixer/fwd:out")} == {
      "lmstep/mixer_pre", "lmstep/mixer_out"}
  cycles = {"mixer/fwd:pre": 100_000, "mixer/fwd:scan": 200_000, "mixer/fwd:out": 50_000,
            "mixer/bwd": 900_000, "ffn/fwd": 300_000, "ffn/bwd": 700_000, "head": 1_500_000}
  parts = {k: dict(status="ok", cycles=c, flops=1e9, times=programs[k][3])
           for k, c in cycles.items()}
  row = step_estimate.estimate(spec, "tpu-v5e", 16, parts)
  mixer = 2 * (100_000 + 3 * 200_000 + 50_000) + 900_000
  assert row["mixer_ms"] == pytest.approx(mixer / chip.clock_hz * 1e3)


@pytest.mark.parametrize("mixer, core, times", [("attention", "mixer/fwd:core", 3),
                                                ("frac", "mixer/fwd:scan", 3)])
def test_remat_mixer_recomputes_the_mixer_less_its_core(mixer, core, times):
  """remat="mixer": the backward runs the mixer's forward again less its core (attention's
  heads from q, k, v, profiled in pieces of 4 of its 12 heads; FRAC's scan), the FFN's whole."""
  chip = perf.CHIPS["tpu-v5e"]
  spec = dict(SPEC, mixer=mixer, remat="mixer")
  programs = step_estimate.part_programs(spec)
  name, direction, overrides, count = programs[core]
  assert (direction, count) == ("fwd", times)
  if mixer == "attention":
    assert (name, overrides["heads"]) == ("lmstep/attention_core", 4)
  cycles = {"mixer/fwd": 500_000, "mixer/fwd:pre": 100_000, "mixer/fwd:scan": 100_000,
            "mixer/fwd:out": 100_000, "mixer/fwd:core": 100_000, "mixer/bwd": 900_000,
            "ffn/fwd": 300_000, "ffn/bwd": 700_000, "head": 1_500_000}
  parts = {k: dict(status="ok", cycles=cycles[k], flops=1e9, times=programs[k][3])
           for k in programs}
  row = step_estimate.estimate(spec, "tpu-v5e", 16, parts)
  assert row["remat"] == "mixer"
  fwd = 500_000
  mixer_half = fwd + (fwd - times * 100_000) + 900_000
  assert row["mixer_ms"] == pytest.approx(mixer_half / chip.clock_hz * 1e3)
  assert row["ffn_ms"] == pytest.approx((2 * 300_000 + 700_000) / chip.clock_hz * 1e3)
  assert "remat mixer" in step_estimate.line(dict(row, context=4096))


def test_a_whole_block_is_one_program():
  """whole_block: the block as one program (forward and VJP under its remat, as libtpu
  schedules the recomputation) counted once per layer; refused for kernel blocks."""
  chip = perf.CHIPS["tpu-v5e"]
  spec = dict(SPEC, whole_block=True, remat="mixer")
  programs = step_estimate.part_programs(spec)
  assert programs == {"block": ("lmstep/block", "fwd+bwd", spec, 1),
                      "head": ("lmstep/head", "fwd+bwd", spec, 1)}
  parts = {"block": dict(status="ok", cycles=2_000_000, flops=1e9),
           "head": dict(status="ok", cycles=1_500_000, flops=1e9)}
  row = step_estimate.estimate(spec, "tpu-v5e", 16, parts)
  assert row["block_ms"] == pytest.approx(2_000_000 / chip.clock_hz * 1e3)
  assert row["compute_ms"] == pytest.approx((12 * 2_000_000 + 1_500_000) / chip.clock_hz * 1e3)
  assert "one program" in step_estimate.line(dict(row, context=4096))
  with pytest.raises(ValueError, match="attention \\+ SwiGLU"):
    step_estimate.part_programs(dict(spec, mixer="frac"))


@pytest.mark.parametrize("half, own", [("mixer", ("norm1", "mixer")), ("ffn", ("norm2", "ffn"))])
def test_a_half_differentiates_its_own_parameters(half, own):
  """A block half's VJP program gives gradients of its own parameters and x only: the other
  half's would be zeros (broadcasts the whole block's program never runs), counted in its
  cycles. Traced abstractly at a short context."""
  import jax
  from flax import nnx

  from benchmarks.aot import perf_programs
  from neurips26_jax.models import LanguageModel
  spec = dict(SPEC, context=256)
  program = perf_programs.build(f"lmstep/{half}", "fwd+bwd", "bfloat16", spec)
  args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in program.specs]
  _, grads = jax.eval_shape(program.fn, *args)
  model = nnx.eval_shape(lambda: LanguageModel(
      vocab_size=32_768, d_model=768, num_layers=1, num_heads=12, context=256,
      rngs=nnx.Rngs(0)))
  shapes = [p.shape for name in own
            for p in jax.tree.leaves(nnx.state(getattr(model.blocks[0], name), nnx.Param))]
  assert sorted(g.shape for g in grads) == sorted(shapes + [(1, 256, 768)])
  assert program.flops == 3 * 2 * 256 * sum(math.prod(s) for s in shapes)
