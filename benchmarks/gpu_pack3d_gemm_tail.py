"""Does a GPU GEMM drop (or double-count) part of its contraction at Pack3D's far-branch shapes?

Ones-matrices check: every operand is 1 (exp(0) where the real code fuses an exp), so each
output element must be exactly K, and K - out is the number of k values the GEMM left out
(a whole number; fp32 holds them exactly, TF32 rounds 1.0 to 1.0). One case per contraction
that feeds Pack3D's far branch, at the shapes of the "two odd fields" case (N = 2649,
C = 78 cubes, chunk 16, H = 2, D = 48), written as the library writes it so that XLA fuses
it the same way; each line also says what the GPU compiler turned it into (cuBLAS call or
Triton fusion, split-K and block_k), after autotuning, which a deviceless compile cannot show.
Each XLA_FLAGS setting runs in its own process (XLA reads the flags once); with the default
flags it then bisects: the real far-branch pieces, GPU against CPU (the reference's old
GEMM cube means and its segment-sum ones, the XLA path's cube summaries, both paths at
radius 1 and 8), to name the first piece that differs. Run by benchmarks/gpu_check.sh:
  python -m benchmarks.gpu_pack3d_gemm_tail               # default, cuBLAS only, Triton only
  python -m benchmarks.gpu_pack3d_gemm_tail --no-bisect   # the ones check alone
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

SETTINGS = {"default": "", "cublas only": "--xla_gpu_enable_triton_gemm=false",
            "triton only": "--xla_gpu_cublas_fallback=false"}


def gemms(hlo: str) -> list[str]:
  """'cublas K=..' / 'triton ...' for every GEMM in an optimized HLO text."""
  shapes = {m.group(1): m.group(2) for m in
            re.finditer(r"%(\S+) = \(?(\w+\[[\d,]*\])", hlo)}
  out = []
  for line in hlo.splitlines():
    if 'custom_call_target="__cublas' in line:
      ops = re.search(r"custom-call\(([^)]*)\)", line).group(1).split(", ")[:2]
      lhs_k = re.search(r'"lhs_contracting_dimensions":\["(\d+)"', line)
      lhs = shapes.get(ops[0].lstrip("%"), "?")
      k = lhs.split("[")[1].rstrip("]").split(",")[int(lhs_k.group(1))] if lhs_k else "?"
      out.append(f"cublas K={k} {lhs} x {shapes.get(ops[1].lstrip('%'), '?')}")
    elif "kind=kCustom" in line and "gemm" in line:
      calls = re.search(r"calls=%([^,\s]+)", line).group(1)
      body = re.search(rf"^%{re.escape(calls)} \(.*?\n\}}", hlo, re.S | re.M)
      body = body.group(0) if body else ""
      block_k = re.findall(r'"sizes":\["(\d+)"\]', body)
      ops = re.search(r"fusion\(([^)]*)\)", line).group(1).split(", ")
      kind = re.search(r'"kind":"([^"]*)"', line)
      config = re.search(r'"triton_gemm_config":(\{[^}]*\})', line)
      warps = re.search(r'"num_warps":"?(\d+)', line)
      stages = re.search(r'"num_stages":"?(\d+)', line)
      result = re.match(r"\s*(?:ROOT )?%(\S+)", line).group(1)
      out.append(f"{kind.group(1) if kind else 'triton'} {[shapes.get(o.lstrip('%'), '?') for o in ops]}"
                 f" -> {shapes.get(result, '?')}"
                 f" block_k={','.join(block_k) or '?'} warps={warps.group(1) if warps else '?'}"
                 f" stages={stages.group(1) if stages else '?'}{' ' + config.group(1) if config else ''}")
  return out


def cases():
  """(name, fn, args, K): fn(*args) must be K everywhere."""
  import jax.numpy as jnp
  n, c, chunk, h, d, t = 2649, 78, 16, 2, 48, 64
  ones = lambda *s: jnp.ones(s, jnp.float32)
  summaries = lambda sc, k, v: [jnp.einsum("bjl,bl...->bj...", sc, x) for x in (k, v)]
  return [
      ("reference summaries (k and v)", summaries, (ones(1, n, n), ones(1, n, h, d), ones(1, n, h, d)), n),
      ("reference P @ [v; vbar]", lambda p, v: jnp.einsum("bhij,bjhd->bihd", p, v),
       (ones(1, h, n, 2 * n), ones(1, 2 * n, h, d)), 2 * n),
      ("XLA path s_far", lambda q, kb, bias: jnp.einsum("cqhd,bhd->chqb", q, kb) + bias[:, None, None],
       (ones(chunk, t, h, d), ones(c, h, d), jnp.zeros((chunk, c), jnp.float32)), d),
      ("XLA path pvbar (exp fused)", lambda s, vb: jnp.einsum("chqb,bhd->cqhd", jnp.exp(s), vb),
       (jnp.zeros((chunk, h, t, c), jnp.float32), ones(c, h, d)), c),
      ("XLA path local pv (exp fused)", lambda s, v: jnp.einsum("chqk,ckhd->cqhd", jnp.exp(s), v),
       (jnp.zeros((chunk, h, t, 27 * t), jnp.float32), ones(chunk, 27 * t, h, d)), 27 * t),
  ]


def ones_check() -> bool:
  import jax
  import jax.numpy as jnp
  ok = True
  for name, fn, args, k in cases():
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    outs = jax.tree.leaves(compiled(*args))
    low = min(float(jnp.min(o)) for o in outs)
    high = max(float(jnp.max(o)) for o in outs)
    wrong = sum(int(jnp.sum(o != k)) for o in outs)
    ok &= wrong == 0
    print(f"  {name}: K={k} out in [{low:g}, {high:g}], {wrong} elements != K"
          f"{f' (short by {k - low:g})' if low < k else ''} ({time.perf_counter() - start:.1f} s)")
    for g in gemms(compiled.as_text()):
      print(f"      {g}")
  return ok


def bisect() -> None:
  """The real far-branch pieces on the GPU against the CPU (relative max difference)."""
  import jax
  import jax.numpy as jnp
  from benchmarks import gpu_pack3d as g
  from neurips26_jax.jaxops import pack3d as ops
  from neurips26_jax.jaxops.pack3d_layout import cube_layout
  coords, field_ids = g.packed(g.CASES["two odd fields"])
  q, k, v = g.qkv(coords.shape[1], jnp.float32)
  cpu, gpu = jax.devices("cpu")[0], jax.devices()[0]
  f32 = lambda x: jnp.asarray(jax.device_get(x), jnp.float32)
  diff = lambda a, b: float(jnp.max(jnp.abs(f32(a) - f32(b))) / max(float(jnp.max(jnp.abs(f32(b)))), 1e-30))

  def same_cube_mean(k, v, coords, field_ids):  # the reference's summaries, as it writes them
    cube = coords // 4
    same = (field_ids[:, :, None] == field_ids[:, None, :]) & (
        jnp.max(jnp.abs(cube[:, :, None] - cube[:, None, :]), -1) == 0)
    sc = same.astype(jnp.float32)
    n = jnp.sum(sc, -1)
    return [jnp.einsum("bjl,bl...->bj...", sc, x) / n[:, :, None, None] for x in (k, v)] + [
        jnp.einsum("bjl,bl...->bj...", sc, jnp.ones_like(k)) - n[:, :, None, None]]  # exact: 0

  def layout_means(k, v):
    layout = cube_layout(coords, field_ids)
    return list(ops.cube_summaries(layout, layout.to_cubes(k), layout.to_cubes(v)))

  def segment_means(k, v, coords, field_ids):  # the reference's now (per_token_cube_sum)
    cube = coords // 4
    same = (field_ids[:, :, None] == field_ids[:, None, :]) & (
        jnp.max(jnp.abs(cube[:, :, None] - cube[:, None, :]), -1) == 0)
    ids = jnp.argmax(same, axis=-1)
    n = ops.per_token_cube_sum(jnp.ones(ids.shape), ids)[..., None, None]
    return [ops.per_token_cube_sum(x, ids) / n for x in (k, v)]

  pieces = {"reference kbar, vbar, count error (GEMM, as it was)": same_cube_mean,
            "reference kbar, vbar (segment sums)": segment_means,
            "XLA path cube_summaries": layout_means}
  for r in (1, 8):
    pieces[f"reference r={r}"] = lambda k, v, r=r: ops.pack3d_attention_reference(q, k, v, coords, field_ids, radius_blocks=r)
    pieces[f"XLA path r={r}"] = lambda k, v, r=r: ops.pack3d_attention(q, k, v, coords, field_ids, radius_blocks=r)
  for name, fn in pieces.items():
    args = (k, v, coords, field_ids) if fn in (same_cube_mean, segment_means) else (k, v)
    on = {dev: jax.tree.leaves(jax.jit(fn)(*jax.device_put(args, dev))) for dev in (gpu, cpu)}
    print(f"  {name}: gpu vs cpu " + ", ".join(
        f"{diff(a, b):.2e}" if float(jnp.max(jnp.abs(f32(b)))) > 0 else f"max|gpu| {float(jnp.max(jnp.abs(f32(a)))):g}"
        for a, b in zip(on[gpu], on[cpu])), flush=True)


def main(argv) -> int:
  if argv[1:2] == ["child"]:
    import jax
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} jax {jax.__version__} {jax.devices()}", flush=True)
    ok = ones_check()
    if "--no-bisect" not in argv and "--bisect" in argv:
      bisect()
    return 0 if ok else 1
  on_gpu = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                          capture_output=True, text=True).stdout.strip() == "gpu"
  status = 0
  for name, flags in (SETTINGS if on_gpu else {"cpu": ""}).items():
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
    print(f"== {name}", flush=True)
    extra = ["--bisect"] if "--no-bisect" not in argv and name in ("default", "cpu") else []
    status |= subprocess.run([sys.executable, "-m", "benchmarks.gpu_pack3d_gemm_tail", "child",
                              *extra], env=env).returncode
  return status


if __name__ == "__main__":
  sys.exit(main(sys.argv))
