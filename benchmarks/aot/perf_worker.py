"""Compiles one `perf_programs` program for one TPU with libtpu's static profile on and prints
`RESULT <json>` (run by perf.py inside .venv-aot-tpu, one program per process: the profile
directory is fixed when libtpu loads, and a large compile can take GBs).

  python -m benchmarks.aot.perf_worker --target=tpu-v5e --program=flash_ffn/kernel \
      --direction=fwd --dtype=bfloat16 [--blocks='{"block_q": 1024}']
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--target", required=True)
  parser.add_argument("--program", required=True)
  parser.add_argument("--direction", required=True, choices=("fwd", "bwd", "fwd+bwd"))
  parser.add_argument("--dtype", required=True)
  parser.add_argument("--blocks", default="{}", help="JSON block-size overrides")
  args = parser.parse_args(argv)
  profile = tempfile.mkdtemp(prefix="perf-profile-")
  from benchmarks.aot.targets import TARGETS, environment
  target = TARGETS[args.target]
  for key, value in environment(target).items():
    os.environ.setdefault(key, value)
  # Masked bf16 matmuls (FRAC) fail the profiler's LLO type check without the second flag;
  # other estimates are unchanged by it.
  os.environ["LIBTPU_INIT_ARGS"] = (f"--xla_jf_dump_static_llo_profile_to={profile} "
                                    "--xla_tpu_check_llo_types=false")
  import jax
  from jax.sharding import NamedSharding, PartitionSpec

  from benchmarks.aot import perf_programs, static_profile
  from benchmarks.aot.targets import device_mesh
  from neurips26_jax.pallas_kernels.dispatch import target_chip

  mesh = device_mesh(target)
  # The kernels' tiles and VMEM budget are the target's, and so is what a program's own
  # tracing chooses (TRACE_FOR: a "bwd" program's forward, traced for its residuals).
  perf_programs.TRACE_FOR.set(lambda: jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
  with target_chip(target.name):
    program = perf_programs.build(args.program, args.direction, args.dtype,
                                  json.loads(args.blocks))
  sharding = NamedSharding(mesh, PartitionSpec())
  specs = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in program.specs]
  start = time.perf_counter()
  result = dict(target=args.target, program=args.program, direction=args.direction,
                dtype=args.dtype, blocks=json.loads(args.blocks), flops=program.flops,
                hbm_bytes=program.hbm_bytes)
  try:
    with target_chip(target.name), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      compiled = jax.jit(program.fn).lower(*specs).compile()
  except Exception as e:  # noqa: BLE001  (the compiler's verdict is the result)
    result.update(status="error", error=f"{type(e).__name__}: {e}"[:600])
    print("RESULT", json.dumps(result), flush=True)
    return
  cycles, per_op = static_profile.total_cycles(static_profile.read_profile(profile),
                                               compiled.as_text())
  kernel = sum(v for k, v in per_op.items() if program.kernel and k.startswith(program.kernel))
  result.update(status="ok", cycles=cycles, kernel_cycles=kernel,
                compile_s=round(time.perf_counter() - start, 1),
                top_ops=dict(sorted(per_op.items(), key=lambda kv: -kv[1])[:6]))
  print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
  sys.exit(main())
