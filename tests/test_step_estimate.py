"""benchmarks/aot/step_estimate.py: a train step as the sum of its single-chip parts, on made-up
part estimates (no compile): the arithmetic of compute, AdamW, the collectives model, MFU, and
the FLOP-floor check."""

import pytest

from benchmarks.aot import perf, step_estimate

SPEC = dict(config="configs/lm_paper.py:125m", mixer="attention", ffn="swiglu", batch=1,
            context=None)


def test_step_is_the_sum_of_its_parts():
  chip = perf.CHIPS["tpu-v5e"]
  facts = step_estimate.model_facts(SPEC)
  assert facts["layers"] == 12 and facts["context"] == 4096
  assert 0.98 * 135e6 < facts["params"] < 1.02 * 135e6
  parts = {"block": dict(status="ok", cycles=3_000_000, flops=1e9),
           "head": dict(status="ok", cycles=1_500_000, flops=1e9)}
  row = step_estimate.estimate(SPEC, "tpu-v5e", 16, parts)
  compute = (12 * 3_000_000 + 1_500_000) / chip.clock_hz
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
  parts = {"block": dict(status="ok", cycles=floor_cycles / 2, flops=1e12),
           "head": dict(status="ok", cycles=floor_cycles, flops=1e12)}
  row = step_estimate.estimate(SPEC, "tpu-v5e", 16, parts)
  assert len(row["untrusted"]) == 1 and row["untrusted"][0].startswith("block")
  assert "untrusted: block" in step_estimate.line(dict(row, context=4096))


def test_a_failed_part_is_the_rows_error():
  parts = {"block": dict(status="crashed", error="libtpu aborted"),
           "head": dict(status="ok", cycles=1, flops=1)}
  row = step_estimate.estimate(SPEC, "tpu-v5e", 16, parts)
  assert row["error"].startswith("block: crashed: libtpu aborted")
