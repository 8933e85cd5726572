"""The SASS report (benchmarks/aot/sass.py) on a hand-written nvdisasm listing: which loop is
the main one, what is counted per iteration, and the occupancy arithmetic."""

from __future__ import annotations

from benchmarks.aot import sass

# A kernel with a setup block, a main loop (a conditional branch back to .L_x_1) holding
# two score HGMMAs from shared memory and one with A from registers, and after EXIT an
# mbarrier retry stub that branches back into the loop (not a loop of the kernel's own).
LISTING = """\
nvdisasm warning : switching to Old format
        .global         k_mosaic_gpu_kernel
.text.k_mosaic_gpu_kernel:
   -:-:1:Y:01        /*0000*/                   USETMAXREG.TRY_ALLOC.CTAPOOL P0, 0xe8 ;
   -:-:-:Y:01        /*0010*/                   STS [R1], R2 ;
.L_x_1:
   -:-:-:Y:01        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3 ;
   -:-:-:Y:01        /*0030*/              @!P0 BRA `(.L_x_9) ;
.L_x_2:
   -:-:-:Y:01        /*0040*/                   WARPGROUP.ARRIVE ;
   -:-:-:Y:01        /*0050*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
   -:-:-:Y:01        /*0060*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24, gsb0 ;
   -:-:-:Y:01        /*0070*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
   -:-:-:Y:01        /*0080*/                   MUFU.EX2 R5, R5 ;
   -:-:-:Y:01        /*0090*/                   MUFU.RCP R6, R5 ;
   -:-:-:Y:01        /*00a0*/                   MUFU.EX2 R7, R7 ;
   -:-:-:Y:01        /*00b0*/                   FCHK P1, R6, R7 ;
   -:-:-:Y:01        /*00c0*/                   STSM.16.M88.4 [R8], R12 ;
   -:-:-:Y:01        /*00d0*/                   FENCE.VIEW.ASYNC.S ;
   -:-:-:Y:01        /*00e0*/                   BAR.SYNC.DEFER_BLOCKING 0x1, 0x80 ;
   -:-:-:Y:01        /*00f0*/                   HGMMA.64x128x16.F32.BF16 R56, R100, gdesc[UR16], R56, gsb0 ;
   -:-:-:Y:01        /*0100*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
   -:-:-:Y:01        /*0110*/              @UP1 UTMALDG.2D [UR20], [UR22] ;
   -:-:-:Y:01        /*0120*/                   STL [R1], R9 ;
   -:-:-:Y:05        /*0130*/               @P2 BRA `(.L_x_1) ;
   -:-:-:Y:05        /*0140*/                   EXIT ;
.L_x_9:
   -:-:-:Y:01        /*0150*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3 ;
   -:-:-:Y:01        /*0160*/              @!P0 BRA `(.L_x_9) ;
   -:-:-:Y:01        /*0170*/                   BRA `(.L_x_2) ;
"""


def test_main_loop_counts_per_iteration():
  (name, s), = sass.summary(LISTING).items()
  assert name == "k_mosaic_gpu_kernel"
  (loop,) = s["loops"]   # the retry stub's branch back to .L_x_2 is not a second loop
  assert loop["instructions"] == 18   # 0x20 .. 0x130
  assert loop["hgmma"] == {"64x128x16": 3}
  assert loop["hgmma_a_from_registers"] == 1
  assert loop["hgmma_flops"] == 3 * 2 * 64 * 128 * 16
  assert (loop["depbar"], loop["depbar_max_in_flight"]) == (2, 1)
  assert loop["mufu"] == {"EX2": 2, "RCP": 1}
  assert (loop["fchk"], loop["smem_stores"], loop["fences"], loop["bar_syncs"]) == (1, 1, 1, 1)
  assert (loop["mbarrier_ops"], loop["tma"], loop["wg_arrive"], loop["local_memory"]) == (1, 1, 1, 1)
  assert s["usetmaxreg"] == ["0xe8"] and s["local_memory"] == 1


def test_kernel_without_a_loop_is_counted_whole():
  straight = "\n".join(l for l in LISTING.splitlines() if "BRA" not in l)
  (loop,) = sass.summary(straight)["k_mosaic_gpu_kernel"]["loops"]
  assert loop["whole_kernel"] and loop["hgmma"] == {"64x128x16": 3}


def test_launch_resolves_the_modules_constants():
  module = ["%c8 = arith.constant 8 : index", "%m_3 = arith.constant 384 : index",
            "%x = gpu.launch blocks(%a, %b, %c) in (%d = %c8, %e = %c8, %f = %c8) "
            "threads(%g, %h, %i) in (%j = %m_3, %k = %c8, %l = %c8) {"]
  assert sass.launch(iter(module)) == {"grid": [8, 8, 8], "threads": [384, 8, 8]}


def test_occupancy():
  # 145 registers x 128 threads: 19 x 256 registers per warp, 3 CTAs; 72 KiB + 1 KiB: 3 fit.
  assert sass.occupancy(145, 128, 72 * 1024, 2048, 132) == {
      "ctas_per_sm": 3, "limited_by": "registers", "waves": 2048 / 396}
  # Three warpgroups at 168 registers fill the register file: one CTA.
  assert sass.occupancy(168, 384, 86 * 1024, 1024, 132)["ctas_per_sm"] == 1
  assert sass.occupancy(32, 128, 120 * 1024, 10, 132)["limited_by"] == "smem"
  # 100 registers take 13 x 256 per warp (not 12.5): 4 CTAs of 4 warps, not 5.
  assert sass.occupancy(100, 128, 1024, 10, 132)["ctas_per_sm"] == 4


# One warpgroup's loop limited by shared memory: two 64x32x16 HGMMAs reading A and B from
# shared memory (3072 B each), one 64x64x16 with A in registers (B: 2048 B), and per warp a
# 16-byte store (512 B), an LDSM of four 8x8 matrices (512 B) and a 2-byte load (64 B).
BOUND_LISTING = """\
.text.s_mosaic_gpu_kernel:
   -:-:-:Y:01 /*0000*/ MOV R1, R2 ;
.L_x_1:
   -:-:-:Y:01 /*0010*/ HGMMA.64x32x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
   -:-:-:Y:01 /*0020*/ HGMMA.64x32x16.F32.BF16 R24, gdesc[UR12], R24 ;
   -:-:-:Y:01 /*0030*/ HGMMA.64x64x16.F32.BF16 R40, R100, gdesc[UR16], R40, gsb0 ;
   -:-:-:Y:01 /*0040*/ STS.128 [R1], R4 ;
   -:-:-:Y:01 /*0050*/ LDSM.16.M88.4 R8, [R2] ;
   -:-:-:Y:01 /*0060*/ LDS.U16 R3, [R2] ;
   -:-:-:Y:01 /*0070*/ MUFU.EX2 R5, R5 ;
   -:-:-:Y:01 /*0080*/ MUFU.TANH R6, R6 ;
   -:-:-:Y:05 /*0090*/ @P2 BRA `(.L_x_1) ;
   -:-:-:Y:05 /*00a0*/ EXIT ;
"""


def test_bound_of_a_loop_limited_by_shared_memory():
  (loop,) = sass.summary(BOUND_LISTING)["s_mosaic_gpu_kernel"]["loops"]
  # 64xNx16 bf16 at 2048 FMA per cycle: N / 2 cycles
  assert loop["tensor_cycles"] == 16 + 16 + 32
  assert loop["hgmma_smem_bytes"] == 2 * (32 * 16 * 2 + 64 * 16 * 2) + 64 * 16 * 2
  assert loop["lds_sts_bytes"] == 512 + 512 + 64
  assert loop["cycles"] == {
      "tensor": 64, "smem": (8192 + 4 * 1088) / 128,   # 4 warps' loads and stores
      "issue": 9, "mufu": 2 * 4 * 32 / 16}             # 9 instructions; 128 results each
  assert loop["cycles_limit"] == "smem" and loop["bound"] == 64 / 98
  flops = 2 * 64 * 16 * (32 + 32 + 64)
  assert loop["hgmma_flops"] == flops
  # at 1.98 GHz on 132 SMs; 2.5 waves take 3 waves' time
  assert sass.tail(2.5) == 2.5 / 3 and sass.tail(0.25) == 0.25 and sass.tail(4.0) == 1.0
  assert abs(sass.predicted_tflops(loop, 2.5, 132)
             - flops / 98 * 132 * 1.98e9 * (2.5 / 3) / 1e12) < 1e-9


def test_bound_of_a_loop_limited_by_the_tensor_cores():
  (loop,) = sass.summary(LISTING)["k_mosaic_gpu_kernel"]["loops"]
  # three 64x128x16: 64 cycles each (issue 47's figure); 2 x 6 KiB + 4 KiB + 4 x 512 B
  assert loop["cycles"] == {"tensor": 192, "smem": 144, "issue": 18, "mufu": 24}
  assert (loop["cycles_limit"], loop["bound"]) == ("tensor", 1.0)
  # all four dense input types take M x N / 128 cycles
  for op in ("HGMMA.64x256x8.F32.TF32", "HGMMA.64x256x32.F32.E4M3"):
    body = [sass.Instruction(0, op, "R24, gdesc[UR8], RZ, !UPT", False, 0)]
    assert sass.counts(body)["tensor_cycles"] == 128


# The shapes of ptxas 13's messages: C7517 before the entry function it names, "in the
# function" or "in function"; one naming no function belongs to the entry compiled next.
PTXAS = """\
ptxas info    : (C7517) warpgroup.wait is injected in around line 594 by compiler to allow \
use of registers defined by GMMA in function 'd_mosaic_gpu_kernel'
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'd_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
ptxas info    : Compiling entry function 'a_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : (C7517) Potential Performance Loss: wgmma.mma_async instructions are \
serialized due to ... in the function 'a_mosaic_gpu_kernel'
ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are \
serialized due to insufficient register resources for the wgmma pipeline in the function \
'a_mosaic_gpu_kernel'
ptxas info    : (C7517) Potential Performance Loss: again in the function 'a_mosaic_gpu_kernel'
ptxas info    : Function properties for a_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 8 bytes cumulative stack size
ptxas info    : (C7519) Potential Performance Loss: a message naming no function
ptxas info    : Compiling entry function 'b_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Compiling entry function 'c_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Used 40 registers (C1234 is not an advisory code of this family)
"""


def test_advisories_per_function():
  assert sass.advisories(PTXAS) == {"d_mosaic_gpu_kernel": ["C7517"],
                                    "a_mosaic_gpu_kernel": ["C7511", "C7517"],
                                    "b_mosaic_gpu_kernel": ["C7519"]}
  # one naming no function after the last entry function is that function's
  tail = "Compiling entry function 'e' for 'sm_90a'\nptxas info    : (C7510) no function\n"
  assert sass.advisories(tail) == {"e": ["C7510"]}


def test_dump_report_and_table_carry_advisories_and_bound(tmp_path):
  (tmp_path / "k_0.sass").write_text(LISTING)
  (tmp_path / "k_0.ptxas").write_text(PTXAS.replace("a_mosaic", "k_mosaic"))
  (tmp_path / "j_0.sass").write_text(BOUND_LISTING.replace("s_mosaic", "j_mosaic"))
  report = sass.dump_report(tmp_path)
  assert report["k_mosaic_gpu_kernel"]["advisories"] == ["C7511", "C7517"]
  assert report["j_mosaic_gpu_kernel"]["advisories"] == []
  kernels = {n: dict(k, registers=168, smem=86 * 1024, threads=[384], grid=[264])
             for n, k in report.items()}
  table = sass.rows([{"case": "c", "kernels": kernels}], 132)
  text = sass.markdown(table)
  assert "| 192 · 144 · 18 · 24 | 100% (tensor) · " in text and "| C7511, C7517 |" in text
  assert "| 64 · 98 · 9 · 16 | 65% (smem) · " in text and "| none |" in text
