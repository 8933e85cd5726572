"""The compile check's own logic (benchmarks/aot): the parsers of what the compilers print,
the pass/fail verdict, and the case list. The compilers themselves run in
`make compile-check` (their own venvs); these tests feed them lines the real compilers
printed (ptxas 12.9 for sm_80/sm_90a, XLA GPU thunk sequences, libtpu's after_codegen).
"""

import pytest

from benchmarks.aot import cases, check, report

PTXAS = """\
I1203 subprocess_compilation.cc:356] ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'pack3d_bwd_dkv' for 'sm_80'
ptxas info    : Function properties for pack3d_bwd_dkv
    5752 bytes stack frame, 7736 bytes spill stores, 7656 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 5752 bytes cumulative stack size
ptxas info    : Compile time = 956.760 ms
ptxas info    : Compiling entry function 'flash_ffn_bwd_dq' for 'sm_90a'
ptxas info    : Function properties for flash_ffn_bwd_dq
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 248 registers, used 1 barriers
ptxas info    : Compile time = 556.590 ms
"""

THUNKS = """\
002: kCustomKernel [source       | next=009 (7) ] loop_broadcast_fusion_7 grid: [1, 1, 1] threads: [2, 1, 1]  shared_memory: 0 bytes
083: kCustomKernel [prev=082 (1) | next=084 (1) ] pack3d_fwd grid: [2, 2, 1024] threads: [128, 1, 1]  shared_memory: 52224 bytes
087: kCustomKernel [prev=086 (1) | next=088 (1) ] pack3d_bwd_dsummary grid: [2, 2, 16] threads: [256, 1, 1]  shared_memory: 66080 bytes
"""

CODEGEN = (
    '  %flash_ffn_bwd_dkuv.1 = (bf16[8,11,256,128]{3,2,1,0:T(8,128)(2,1)}) custom-call(%fusion.6), '
    'custom_call_target="tpu_custom_call", backend_config={"used_scoped_memory_configs":'
    '[{"memory_space":"1","offset":"0","size":"3903488"}],"retry_config":{"retry_count":"0"}}\n'
    '  %flash_ffn_fwd.3 = f32[4096,1024]{1,0:T(8,128)S(1)} custom-call(%a), '
    'custom_call_target="tpu_custom_call", backend_config={"used_scoped_memory_configs":'
    '[{"memory_space":"1","offset":"0","size":"1077248"}]}\n'
    '  %flash_ffn_bwd_dq.1.ds_ref = f32[4096,1024]{1,0:T(8,128)} custom-call(%b), '
    'custom_call_target="tpu_custom_call", backend_config={"used_scoped_memory_configs":'
    '[{"memory_space":"1","offset":"0","size":"2174976"}]}\n'
    '  %pack3d_fwd.11 = (f32[8,3072,96]{2,1,0:T(8,128)S(1)}) fusion(%a, %b), kind=kCustom, '
    'calls=%fused_computation.31.clone, metadata={op_name="jit(op)/while/body/pack3d_fwd/'
    'pallas_call" stack_frame_id=130}, backend_config={"used_scoped_memory_configs":'
    '[{"memory_space":"1","offset":"0","size":"499712"}]}\n'
    '  %fusion.2 = f32[8]{0} fusion(%p), kind=kLoop\n')


def test_ptxas_report_per_entry_function():
  got = report.ptxas(PTXAS)
  assert got == {
      "pack3d_bwd_dkv": dict(stack=5752, spill_stores=7736, spill_loads=7656, registers=32,
                             ptxas_ms=956.76),
      "flash_ffn_bwd_dq": dict(stack=0, spill_stores=0, spill_loads=0, registers=248,
                               ptxas_ms=556.59)}


def test_dump_parsers(tmp_path):
  (tmp_path / "module_0001.jit_grad.thunk_sequence.txt").write_text(THUNKS)
  (tmp_path / "module_0000.jit_fwd.after_codegen.txt").write_text(CODEGEN)
  assert report.gpu_shared_memory(tmp_path) == {
      "loop_broadcast_fusion_7": 0, "pack3d_fwd": 52224, "pack3d_bwd_dsummary": 66080}
  assert report.tpu_scoped_vmem(tmp_path) == {"flash_ffn_bwd_dkuv": 3903488,
                                              "flash_ffn_fwd": 1077248,
                                              "flash_ffn_bwd_dq": 2174976,
                                              "pack3d_fwd": 499712}
  error = ("JaxRuntimeError: RESOURCE_EXHAUSTED: Shared memory size limit exceeded: "
           "requested 917504, available: 232448")
  assert report.requested_shared_memory(error) == 917504


MOSAIC_PTXAS = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'flash_ffn_bwd_dq_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for flash_ffn_bwd_dq_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 180 registers, used 2 barriers, 1 bytes smem
ptxas info    : Compile time = 220.886 ms
"""
MOSAIC_RESOURCES = ("Resources(smem_scratch_bytes={}, tmem_scratch_cols=0, "
                    "tmem_collective_scratch_cols=0, barrier_counts=Counter(), "
                    "scoped_gmem_semaphores={{}})")


def test_mosaic_gpu_dump_parser(tmp_path):
  """Mosaic GPU's dump numbers lowering and compile files separately (dq_1.ptxas goes with
  dq_2.resources.txt); a kernel compiled in an earlier case has resources but no ptxas."""
  (tmp_path / "flash_ffn_bwd_dq_1.ptxas").write_text(MOSAIC_PTXAS)
  (tmp_path / "flash_ffn_bwd_dq_2.resources.txt").write_text(MOSAIC_RESOURCES.format(98304))
  (tmp_path / "flash_ffn_fwd_1.resources.txt").write_text(MOSAIC_RESOURCES.format(72704))
  assert report.mosaic_gpu(tmp_path) == {
      "flash_ffn_bwd_dq_mosaic_gpu_kernel": dict(
          stack=0, spill_stores=0, spill_loads=0, registers=180, ptxas_ms=220.886, smem=98304),
      "flash_ffn_fwd_mosaic_gpu_kernel": dict(smem=72704)}
  error = ("ValueError: Mosaic GPU kernel exceeds available shared memory: "
           "smem_bytes=248864 > max_smem_bytes=232448")
  assert report.requested_shared_memory(error) == 248864


def _result(**overrides):
  r = {"case": "pack3d/65k/grad/float32", "target": "gpu-a100", "status": "ok",
       "expect_failure": False, "compile_s": 7.0, "hbm_temp": 2**20,
       "kernels": {"pack3d_bwd_dkv": dict(smem=41088, registers=255, spill_stores=96,
                                          spill_loads=92)}}
  r.update(overrides)
  return r


@pytest.mark.parametrize("overrides, why", [
    ({}, ""),
    ({"compile_s": 61.0}, "compile took 61 s"),
    ({"kernels": {"k": dict(spill_stores=600, spill_loads=500)}}, "k spills 1100 B"),
    ({"kernels": {"k": dict(spill_stores=512, spill_loads=512)}}, ""),  # 1 KiB is allowed
    ({"kernels": {}}, "no Pallas kernel in the compiled program"),
    ({"status": "timeout", "error": "no result after 300 s"}, "timeout"),
    ({"status": "error", "error": "RESOURCE_EXHAUSTED: Shared memory size limit exceeded"},
     "error"),
    # an oversized block must be refused for its memory, and for nothing else
    ({"expect_failure": True, "status": "error",
      "error": "JaxRuntimeError: RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom"}, ""),
    ({"expect_failure": True, "status": "error", "error": "ValueError: Mosaic GPU kernel exceeds "
      "available shared memory: smem_bytes=1674288 > max_smem_bytes=232448"}, ""),
    ({"expect_failure": True},
     "an oversized block was not refused for its memory"),
    ({"expect_failure": True, "status": "error", "error": "ValueError: bad block"},
     "an oversized block was not refused for its memory"),
])
def test_verdict(overrides, why):
  assert check.verdict(_result(**overrides)) == why


def test_markdown_marks_failures_and_expected_failures():
  table = check.markdown([
      _result(),
      _result(target="gpu-h100", compile_s=75.0),
      _result(case="flash_ffn/370m/fwd/float32+block_q=256", target="gpu-h200",
              expect_failure=True, status="error",
              error="RESOURCE_EXHAUSTED: Shared memory size limit exceeded")])
  rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:] if line}
  assert "40K · 255 · 188 · 7.0" in rows["pack3d/65k/grad/float32 pack3d_bwd_dkv"]
  assert "**FAIL** (compile took 75 s)" in rows["pack3d/65k/grad/float32 pack3d_bwd_dkv"]
  assert "expected failure: error: RESOURCE_EXHAUSTED" in table


def test_cases_cover_the_issue_shapes_and_round_trip():
  for kind in ("tpu", "gpu"):
    every = cases.all_cases(kind)
    names = {c.name for c in every}
    for op, shape in (("flash_ffn", "370m"), ("pack3d", "65k"), ("frac_scan", "16k")):
      for direction in ("fwd", "grad"):
        for dtype in ("float32", "bfloat16"):
          assert f"{op}/{shape}/{direction}/{dtype}" in names
    assert sum(c.expect_failure for c in every) == 1
    for c in every:
      assert cases.parse(c.name) == c
  hopper = cases.all_cases("gpu", generation="hopper")
  assert [c.backend for c in hopper if c.expect_failure] == ["", "mosaic_gpu"]
  # the warp-specialized FlashFFN bodies (opt-in) compile for Hopper only
  ws = [c for c in hopper if ("compute_wgs", 2) in c.blocks]
  assert len(ws) == 4 and set(ws) < set(cases.OPT_IN["hopper"])
  assert not any(("compute_wgs", 2) in c.blocks
                 for c in cases.all_cases("gpu", generation="blackwell"))
  # the Mosaic GPU bodies backend=None does not pick stay compiled, bf16, every shape: FRAC's
  # and Pack3D's for Hopper, FlashFFN's tcgen05 one for Blackwell
  forced = lambda generation, op: {
      c.name.replace("@mosaic_gpu", "") for c in cases.all_cases("gpu", generation=generation)
      if c.op == op and c.backend == "mosaic_gpu" and not c.blocks}
  default = lambda op: {c.name for c in cases.all_cases("gpu") if c.op == op
                        and c.dtype == "bfloat16" and not c.expect_failure}
  for op in ("pack3d", "frac_scan"):
    assert forced("hopper", op) == default(op) and not forced("blackwell", op)
  for op in ("flash_ffn", "flash_ffn_routed"):
    assert forced("blackwell", op) == default(op)
  for c in hopper:
    assert cases.parse(c.name) == c
  # B200: the Blackwell kernel's own oversized case (its tiles are at most 128 rows).
  blackwell = [c for c in cases.all_cases("gpu", generation="blackwell") if c.expect_failure]
  assert [c.backend for c in blackwell] == ["", "mosaic_gpu"]
  assert blackwell[1] == cases.OVERSIZED["blackwell"] == cases.parse(blackwell[1].name)
  assert cases.SHAPES["flash_ffn"]["370m"] == dict(b=1, l=16384, h=8, d=128, e=11, f=256)
  assert cases.SHAPES["pack3d"]["65k"]["b"] == 2
  assert cases.SHAPES["frac_scan"]["16k"] == dict(b=1, l=16384, h=4, p=64, n=16, m=16)


def test_ci_subset_keeps_every_kernel_variant_and_the_largest_grids():
  """What CI compiles still has every op in both directions and dtypes, each Pack3D head
  width and level count in each dtype and with and without a far offset, the 1M-token grids
  and the oversized case."""
  every = cases.all_cases("tpu")
  ci = cases.ci_cases(every)
  assert set(ci) < set(every) and [c for c in ci if c.expect_failure] == [cases.OVERSIZED["tpu"]]
  variant = lambda c: (c.op, c.direction, c.dtype)
  assert {variant(c) for c in ci} == {variant(c) for c in every}
  shape = lambda c: cases.SHAPES[c.op][c.shape]
  for key in (lambda c: (c.dtype, shape(c)["d"], shape(c).get("levels", 1)),
              lambda c: (shape(c)["d"], shape(c).get("levels", 1), "far_offset" in shape(c))):
    assert ({key(c) for c in ci if c.op == "pack3d"}
            == {key(c) for c in every if c.op == "pack3d"})
  assert {c.shape for c in ci if c.op == "pack3d"} >= {"1m", "1m_seg3d_l3"}
  assert {c.op for c in ci if c.op != "pack3d"} == {c.op for c in every if c.op != "pack3d"}
  assert [c for c in every if c.op != "pack3d" and c not in ci] == []


def test_merge_replaces_only_the_target_op_pairs_that_ran():
  """A run of one op on some targets keeps every other op's rows of those targets and drops
  the rerun pairs' old rows (cases that no longer exist included)."""
  row = lambda target, case, tag: {"target": target, "case": case, "tag": tag}
  previous = [row("gpu-a100", "flash_ffn/lm/fwd/float32", "old"),
              row("gpu-h100", "flash_ffn/lm/fwd/float32", "old"),
              row("gpu-h100", "flash_ffn/lm/fwd/float32@mosaic_gpu+block_q=9", "old"),
              row("gpu-h100", "pack3d/65k/fwd/float32", "old")]
  merged = check.merge(previous, [row("gpu-h100", "flash_ffn/lm/fwd/float32", "new")])
  assert sorted((r["target"], r["case"], r["tag"]) for r in merged) == [
      ("gpu-a100", "flash_ffn/lm/fwd/float32", "old"),
      ("gpu-h100", "flash_ffn/lm/fwd/float32", "new"),
      ("gpu-h100", "pack3d/65k/fwd/float32", "old")]


def test_merge_of_some_shapes_replaces_only_those_shapes():
  """--shapes: a run of one shape keeps the op's other shapes (and its oversized case) on that
  target; the all_cases filter leaves the oversized cases out of such a run."""
  row = lambda target, case, tag: {"target": target, "case": case, "tag": tag}
  previous = [row("tpu-v5e", "pack3d/65k/fwd/float32", "old"),
              row("tpu-v5e", "pack3d/1m/fwd/float32", "old"),
              row("tpu-v6e", "pack3d/1m/fwd/float32", "old")]
  merged = check.merge(previous, [row("tpu-v5e", "pack3d/1m/fwd/float32", "new")],
                       whole_ops=False)
  assert sorted((r["target"], r["case"], r["tag"]) for r in merged) == [
      ("tpu-v5e", "pack3d/1m/fwd/float32", "new"),
      ("tpu-v5e", "pack3d/65k/fwd/float32", "old"),
      ("tpu-v6e", "pack3d/1m/fwd/float32", "old")]
  assert not any(c.expect_failure for c in cases.all_cases("tpu", {"pack3d"}))  # flash_ffn's
  some = cases.all_cases("tpu", {"pack3d"}, shapes={"1m"})
  assert {c.name for c in some} == {f"pack3d/1m/{d}/{t}" for d in ("fwd", "grad")
                                    for t in ("float32", "bfloat16")}
