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
