"""`python -m tests.binary_cases < cases.json`: each case's training binary, run in a forked
child of one process that has already imported both binaries, so a table of command lines costs
one start-up of Python and JAX instead of one each. The child runs the binary's own __main__
(absl flag parsing, checks, training) on the case's argv, exactly as `python -m MODULE ARGV`.

stdin: [{"module": "neurips26_jax.train.train_lm", "argv": ["--config=...", ...]}, ...]
stdout: one JSON list of {"status": exit status, "output": stdout + stderr, "seconds": wall time}
"""

import json
import os
import runpy
import sys
import tempfile
import time
import traceback

import neurips26_jax.train.cli  # noqa: F401  (the imports every child shares)
import neurips26_jax.train.lm_task  # noqa: F401
import neurips26_jax.train.seg3d_task  # noqa: F401


def _child(module: str, argv: list[str]) -> int:
  sys.argv = [module, *argv]
  try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
  except SystemExit as e:
    if isinstance(e.code, str):
      sys.stderr.write(e.code + "\n")
    return e.code if isinstance(e.code, int) else int(e.code is not None)
  except BaseException:  # noqa: BLE001  (reported like the interpreter would)
    traceback.print_exc()
    return 1
  return 0


def run(module: str, argv: list[str]) -> dict:
  with tempfile.TemporaryFile() as out:
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
      os.dup2(out.fileno(), 1)
      os.dup2(out.fileno(), 2)
      status = _child(module, argv)
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(status)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    seconds = time.perf_counter() - start
    out.seek(0)
    return {"status": status, "output": out.read().decode(errors="replace"), "seconds": seconds}


if __name__ == "__main__":
  cases = json.load(sys.stdin)
  results = [run(c["module"], c["argv"]) for c in cases]
  sys.stdout.write(json.dumps(results))
