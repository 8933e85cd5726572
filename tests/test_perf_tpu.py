"""`make perf-tpu`'s arithmetic (the static profile's loop weighting, the table's reading) and
that FlashFFN's tuned TPU tiles are the block sweep's best (benchmarks/aot/perf_sweep.json)."""

from __future__ import annotations

import json

import pytest

from benchmarks.aot import perf, static_profile
from neurips26_jax.pallas_kernels.flash_ffn import blocks

# An entry with a while loop of 8 trips whose body holds a loop of 3: as libtpu's optimized
# HLO prints them (computations first, the entry last).
HLO = """HloModule m

%inner_cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %constant.3 = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %constant.3), direction=LT
}

%inner_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %fusion.inner = f32[8] fusion(%p), kind=kLoop, calls=%f
  ROOT %t = (s32[], f32[8]) tuple(%i, %fusion.inner)
}

%outer_cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %constant.8 = s32[]{:T(128)} constant(8)
  ROOT %lt = pred[] compare(%i, %constant.8), direction=LT
}

%outer_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %fusion.outer = f32[8] fusion(%p), kind=kLoop, calls=%g
  %while.inner = (s32[], f32[8]) while(%p), condition=%inner_cond, body=%inner_body
  ROOT %t = (s32[], f32[8]) tuple(%i, %fusion.outer)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8] parameter(0)
  %copy.1 = f32[8] copy(%a)
  %while.outer = (s32[], f32[8]) while(%t0), condition=%outer_cond, body=%outer_body
  ROOT %r = f32[8] get-tuple-element(%while.outer), index=1
}
"""


def test_loop_bodies_count_trip_count_times():
  runs = static_profile.multipliers(HLO)
  assert runs["copy.1"] == 1 and runs["fusion.outer"] == 8 and runs["fusion.inner"] == 24
  total, per_op = static_profile.total_cycles(
      {"copy.1": 10, "fusion.outer": 100, "fusion.inner": 1000}, HLO)
  assert per_op == {"copy.1": 10, "fusion.outer": 800, "fusion.inner": 24_000}
  assert total == 24_810


def test_a_loop_without_one_bound_is_an_error():
  with pytest.raises(ValueError, match="trip count"):
    static_profile.trip_count(["%c = s32[] constant(3)", "%d = s32[] constant(4)"])


def test_reading_takes_the_larger_of_estimate_and_hbm_floor():
  chip = perf.CHIPS["tpu-v5e"]
  compute_bound = dict(target="tpu-v5e", cycles=1_000_000, flops=chip.flops_per_cycle * 500_000,
                       hbm_bytes=int(chip.hbm_bytes_per_s * 1e-6))     # 1 us of traffic
  r = perf.reading(compute_bound)
  assert r["us"] == pytest.approx(1e6 / chip.clock_hz * 1e6) and r["mfu"] == pytest.approx(0.5)
  assert r["read_us"] == r["us"]
  memory_bound = dict(compute_bound, hbm_bytes=int(chip.hbm_bytes_per_s))  # 1 s of traffic
  assert perf.reading(memory_bound)["read_us"] == pytest.approx(1e6, rel=1e-6)


def test_tuned_tpu_tiles_are_the_sweep_best():
  """Each chip's FlashFFN entry in blocks.TUNED is what `perf --sweep` found best there."""
  best = json.loads(perf.SWEEP.read_text())["best"]
  assert best, "perf_sweep.json holds no sweep"
  for chip, by_dtype in best.items():
    for dtype, fields in by_dtype.items():
      entry = blocks.TUNED[("mosaic", chip, dtype)]
      assert {f: getattr(entry, f) for f in fields} == fields, (chip, dtype)


def test_a_row_of_parts_sums_their_compiles(monkeypatch):
  """flash_ffn/kernels fwd+bwd is the forward kernel's compile plus the backward kernel's."""
  def fake_worker(target, program, direction, dtype, blocks, timeout, max_rss_gb):
    assert direction == "fwd"
    n = {"flash_ffn/fwd_kernel": 1, "flash_ffn/bwd_kernel": 2}[program]
    return dict(target=target, program=program, direction=direction, dtype=dtype, status="ok",
                flops=10 * n, hbm_bytes=100 * n, cycles=1000 * n, kernel_cycles=900 * n,
                compile_s=1.0 * n, top_ops={f"op{n}": 900 * n}, peak_rss_gb=float(n))
  monkeypatch.setattr(perf, "run_worker", fake_worker)
  row = perf.run_row("tpu-v5e", "flash_ffn/kernels", "fwd+bwd", "bfloat16", 1, 1)
  assert (row["program"], row["direction"], row["status"]) == ("flash_ffn/kernels", "fwd+bwd", "ok")
  assert (row["flops"], row["hbm_bytes"], row["cycles"], row["kernel_cycles"]) == (30, 300, 3000, 2700)
  assert row["top_ops"] == {"op1": 900, "op2": 1800} and row["peak_rss_gb"] == 2.0
  fwd = perf.run_row("tpu-v5e", "flash_ffn/kernels", "fwd", "bfloat16", 1, 1)
  assert fwd["cycles"] == 1000

  def failing_bwd(target, program, *a):
    r = fake_worker(target, program, *a)
    return r if program.endswith("fwd_kernel") else dict(r, status="crashed", error="abort")
  monkeypatch.setattr(perf, "run_worker", failing_bwd)
  row = perf.run_row("tpu-v5e", "flash_ffn/kernels", "fwd+bwd", "bfloat16", 1, 1)
  assert (row["status"], row["error"]) == ("crashed", "abort")


@pytest.mark.parametrize("direction,calls", [("fwd", 1), ("fwd+bwd", 4)])
def test_pack3d_kernels_program_is_the_kernels_alone(direction, calls):
  """perf's pack3d/kernels row lowers for TPU to Pack3D's Mosaic calls and no gather (the
  layout stage's gathers are what abort libtpu's profiler)."""
  import jax
  from benchmarks.aot import perf_programs
  program = perf_programs.build("pack3d/kernels", direction, "bfloat16")
  args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in program.specs]
  module = jax.export.export(jax.jit(program.fn), platforms=["tpu"])(*args).mlir_module()
  assert module.count("tpu_custom_call") == calls and "gather" not in module


@pytest.mark.parametrize("which", ["fwd_kernel", "bwd_kernel", "routed_fwd_kernel",
                                   "routed_bwd_kernel"])
def test_flash_ffn_kernel_programs_are_one_kernel_each(which):
  """Each part of the flash_ffn/kernels and routed_kernels rows is one Mosaic call on v5e's
  tiles (the routed backward exists only when a head's tables fit one expert group)."""
  import jax
  from benchmarks.aot import perf_programs
  from neurips26_jax.pallas_kernels.dispatch import target_chip
  with target_chip("tpu-v5e"):
    program = perf_programs.build(f"flash_ffn/{which}", "fwd", "bfloat16")
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in program.specs]
    module = jax.export.export(jax.jit(program.fn), platforms=["tpu"])(*args).mlir_module()
  assert module.count("tpu_custom_call") == 1


def test_a_crash_says_libtpus_reason():
  log = ("WARNING: something\nF1206 09:55:09.232064    7631 llo_dumper.cc:1697] Static LLO "
         "profiling of pack3d_bwd_dq.1 failed: INVALID_ARGUMENT: Unsupported DMA direction\n"
         "*** Check failure stack trace: ***\nF1206 09:55:09.2 7631 x.cc:1] again\n")
  assert perf.abort_reason(log) == ("Static LLO profiling of pack3d_bwd_dq.1 failed: "
                                    "INVALID_ARGUMENT: Unsupported DMA direction")
  assert perf.abort_reason("Segmentation fault") == "libtpu aborted"
