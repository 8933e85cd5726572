"""The programs `make perf-tpu` compiles: each op's Pallas kernel beside the XLA programs it
replaces, and the layers beside the layers they replace.

`build(name, direction, dtype, overrides)` -> `Program`: the jittable function with its
argument specs, the model FLOPs of its matmuls and the bytes it must move at least (the HBM
floor). Model FLOPs count the math once: a forward of n matmul units, a backward of 2n
(recomputation inside a kernel or under jax.checkpoint is not counted), so a kernel that
recomputes its forward reaches at most (3 + 6) / (3 + 8) = 82% of peak in fwd+bwd; the
ratio of cycles to the baseline is the comparison that matters.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Callable

# The FlashFFN op at the paper's 370M head shape (the static-estimate shape).
FFN = dict(b=1, l=4096, h=8, d=128, e=11, f=256)
# SwiGLU matched in FLOPs to it: d = H d_h and d d_ff = H d_h E d_e, so d_ff = E d_e.
SWIGLU = dict(d=FFN["h"] * FFN["d"], d_ff=FFN["e"] * FFN["f"])
# FRAC at the benchmark's head shape; the profiler's memory grows with the program (FRAC's
# kernel at L = 8192 passed 14 GB), so L = 2048 (per-token figures were stable across sizes).
FRAC = dict(b=1, l=2048, h=4, p=64, n=16, m=16)
# Pack3D: a 16 x 32 x 32 token grid (16,384 tokens in 256 cubes of 4^3), two heads of 48.
PACK3D = dict(b=1, grid=(16, 32, 32), h=2, d=48)
# Layers at the 370M width and 4k tokens.
LAYER = dict(b=1, l=4096, d=1024)


@dataclasses.dataclass(frozen=True)
class Program:
  fn: Callable
  specs: list          # [(shape, dtype), ...]
  flops: int           # model FLOPs of its matmuls (see the module docstring)
  hbm_bytes: int       # what it must read and write at least
  kernel: str = ""     # the Pallas kernels' name prefix ("" for XLA programs)


def _nbytes(specs) -> int:
  import jax.numpy as jnp
  return sum(math.prod(shape) * jnp.dtype(dtype).itemsize for shape, dtype in specs)


# A context for the tracing `build` does itself (a "bwd" program's forward, for its residuals'
# shapes): perf_worker sets the target's abstract mesh, so that choices made while tracing
# (FRAC's chunk on TPU) are the target's, not this CPU's.
TRACE_FOR = contextvars.ContextVar("TRACE_FOR", default=contextlib.nullcontext)


def _with_grad(fn, specs, num_diff: int, flops: int, kernel: str, direction: str) -> Program:
  """The forward, or forward + the VJP of the first `num_diff` arguments (cotangent = the
  output, so nothing is left for XLA to prune); FLOPs x3 and bytes x3 for fwd+bwd (the
  backward reads the inputs and the cotangent, writes a gradient per input). "bwd": the VJP
  alone, its arguments the forward's residuals and the cotangent (FLOPs x2)."""
  import jax
  if direction == "fwd":
    return Program(fn, specs, flops, _nbytes(specs), kernel)
  pullback = lambda *a: jax.vjp(lambda *d: fn(*d, *a[num_diff:]), *a[:num_diff])
  if direction == "bwd":
    structs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs]
    with TRACE_FOR.get()():  # the forward is traced here, for the target's choices
      out, vjp = jax.eval_shape(pullback, *structs)
    residuals, treedef = jax.tree.flatten(vjp)   # a jax.tree_util.Partial: its residuals
    bwd_specs = [(r.shape, r.dtype) for r in residuals] + [(out.shape, out.dtype)]
    bwd = lambda *a: jax.tree.unflatten(treedef, a[:-1])(a[-1])
    return Program(bwd, bwd_specs, 2 * flops, 2 * _nbytes(specs), kernel)

  def grad(*args):
    out, vjp = pullback(*args)
    return out, vjp(out)

  return Program(grad, specs, 3 * flops, 3 * _nbytes(specs), kernel)


def _flash_ffn(impl: str, dtype, overrides: dict):
  import jax.numpy as jnp
  s = FFN
  table = ((s["h"], s["e"], s["f"], s["d"]), dtype)
  specs = [((s["b"], s["l"], s["h"], s["d"]), dtype),
           ((s["b"], s["l"], s["h"], s["e"]), jnp.float32), table, table, table]
  flops = 2 * 3 * s["b"] * s["l"] * s["h"] * s["d"] * s["e"] * s["f"]
  if impl == "kernel":
    from neurips26_jax.pallas_kernels.flash_ffn import mhffn
    return (lambda *a: mhffn(*a, interpret=False, backend="mosaic", **overrides)), specs, flops
  from neurips26_jax.jaxops.flash_ffn import mhffn
  return (lambda *a: mhffn(*a, chunk=512)), specs, flops


def _flash_ffn_kernel_only(which: str, dtype, overrides: dict):
  """The forward or the backward Mosaic kernel alone, on inputs already in its layout: what
  the block-size sweep compares (the op adds only layout copies, and through the op the
  profiler takes ~10x longer to compile; its fwd+bwd ran past 16 GB)."""
  import jax
  import jax.numpy as jnp
  from neurips26_jax.pallas_kernels.flash_ffn import BlockSizes, mosaic, tiles
  # "wide_": half the heads at twice the width, the same FLOPs (d_h = 256 fills a v6e MXU's
  # depth where 128 fills half of it).
  # "lm370frac_": the tables of configs/lm_paper.py:370m with the FRAC mixer (E = 9, d_e = 264,
  # not a multiple of the 256-row tile: how the Mosaic kernels' d_e tile pads it).
  s = (dict(FFN, h=FFN["h"] // 2, d=2 * FFN["d"]) if which.startswith("wide_")
       else dict(FFN, e=9, f=264) if which.startswith("lm370frac_") else FFN)
  blocks = dataclasses.replace(BlockSizes.for_backend("mosaic", dtype), **overrides)
  q = jax.ShapeDtypeStruct((s["b"], s["l"], s["h"], s["d"]), dtype)
  k = jax.ShapeDtypeStruct((s["h"], s["e"], s["f"], s["d"]), dtype)
  plan = tiles.TilePlan.make("mosaic", blocks, q, k)
  tokens = (plan.tokens, plan.heads * plan.d_h)
  table = ((s["h"], plan.table_experts, plan.d_e, plan.d_h), dtype)
  router = ((s["h"], plan.experts_pad, plan.tokens), jnp.float32)
  flops = 2 * 3 * s["b"] * s["l"] * s["h"] * s["d"] * s["e"] * s["f"]
  routed = "routed_" in which
  route, extra = None, {}
  if routed:
    # As the layer runs them: W_r [H, d_h, E padded to 128 lanes] in place of the router
    # weights, the tables as stored (float32) and the norm gain [H, 1, d_h].
    router = ((s["h"], s["d"], -(-s["e"] // 128) * 128), dtype)
    table = (table[0], jnp.float32)
    flops += 2 * s["b"] * s["l"] * s["h"] * s["d"] * s["e"]
    route = mosaic.Router(True, s["e"])
    extra = {"gain": ((s["h"], 1, plan.d_h), jnp.float32)}
  inputs = [(tokens, dtype), router] + [table] * 3 + list(extra.values())
  if which.endswith("fwd_kernel"):
    return (lambda q, r, k, u, v, *g: mosaic.forward(plan, q, r, k, u, v, False, router=route,
                                                     **dict(zip(extra, g)))), inputs, flops
  return (lambda q, r, k, u, v, *g_ds: mosaic.backward(
      plan, q, r, r, k, u, v, g_ds[-1], False, router=route,
      **dict(zip(extra, g_ds[:-1])))), inputs + [(tokens, dtype)], 2 * flops


def _swiglu(dtype):
  from neurips26_jax.jaxops.flash_ffn import swiglu
  d, f, tokens = SWIGLU["d"], SWIGLU["d_ff"], FFN["b"] * FFN["l"]
  specs = [((tokens, d), dtype), ((d, f), dtype), ((d, f), dtype), ((f, d), dtype)]
  return swiglu, specs, 2 * 3 * tokens * d * f


def _frac(impl: str, dtype, overrides: dict):
  """overrides: the kernel's block sizes, "chunk", and "shape" (FRAC's keys, a layer's)."""
  import jax.numpy as jnp
  s = {**FRAC, **overrides.pop("shape", {})}
  tok = (s["b"], s["l"], s["h"])
  specs = [(tok + (s["p"],), dtype), (tok, jnp.float32), (tok + (s["n"],), dtype),
           (tok + (s["n"],), dtype), ((s["h"], s["m"]), jnp.float32),
           ((s["h"], s["m"]), jnp.float32)]
  from neurips26_jax.pallas_kernels.dispatch import current_chip
  from neurips26_jax.pallas_kernels.frac_scan.blocks import TPU_CHUNK
  # Both paths at the kernel's default chunk on this chip (the same math, like for like).
  chunk = overrides.pop("chunk", TPU_CHUNK.get(current_chip(), TPU_CHUNK[None]))
  # Per chunk of c tokens and mode: the intra-chunk [c, c] scores (C B^T, masked) and their
  # product with x, plus the state's read-out and update: ~ 2 L (c N + c P + 2 N P) per mode.
  flops = 2 * s["b"] * s["l"] * s["h"] * s["m"] * (chunk * s["n"] + chunk * s["p"]
                                                  + 2 * s["n"] * s["p"])
  if impl == "kernel":
    from neurips26_jax.pallas_kernels.frac_scan import frac_scan
    fn = lambda *a: frac_scan(*a, interpret=False, backend="mosaic", chunk=chunk,
                              **overrides)[0]
  else:
    from neurips26_jax.jaxops import frac
    fn = lambda *a: frac.frac_scan(*a, chunk=chunk)[0]
  return fn, specs, flops


def _pack3d(impl: str, dtype, overrides: dict):
  import jax.numpy as jnp
  s = PACK3D
  n = math.prod(s["grid"])
  x = ((s["b"], n, s["h"], s["d"]), dtype)
  specs = [x, x, x, ((s["b"], n, 3), jnp.int32), ((s["b"], n), jnp.int32)]
  cubes = math.prod(g // 4 for g in s["grid"])
  # Local: each cube's 64 queries against its 27 neighbour cubes' keys; far: against every
  # cube summary. Two products (scores, values) of d each.
  flops = 2 * 2 * s["b"] * n * s["h"] * s["d"] * (27 * 64 + cubes)
  if impl == "dense":
    flops = 2 * 2 * s["b"] * n * n * s["h"] * s["d"]

    def fn(q, k, v, coords, field_ids):
      del coords, field_ids
      import jax
      scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
      p = jax.nn.softmax(scores / math.sqrt(s["d"]), axis=-1).astype(v.dtype)
      return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return fn, specs, flops
  if impl == "kernel":
    from neurips26_jax.pallas_kernels.pack3d_attention import pack3d_attention
    return (lambda q, k, v, c, f: pack3d_attention(q, k, v, c, f, max_cubes=cubes,
                                                   interpret=False, **overrides)), specs, flops
  from neurips26_jax.jaxops import pack3d
  return (lambda q, k, v, c, f: pack3d.pack3d_attention(q, k, v, c, f, max_cubes=cubes)), \
      specs, flops


def _pack3d_kernels(dtype, overrides: dict):
  """Pack3D's Mosaic kernels alone (`attend`), on operands in their slot layout: the op's
  layout stage (sorts and gathers in XLA) aborts libtpu's profiler, the kernels do not."""
  import jax
  from neurips26_jax.pallas_kernels import pack3d_attention as kernels
  _, specs, flops = _pack3d("kernel", dtype, overrides)
  static = {}

  def operands(q, k, v, coords, field_ids):
    ops, static["cfg"], static["options"], _ = kernels.kernel_operands(
        q, k, v, coords, field_ids, block_shape=(4, 4, 4), radius_blocks=1, block_bias=True,
        summary_rope=None, far_offset=None, max_cubes=math.prod(g // 4 for g in PACK3D["grid"]),
        levels=1, level_radius=None, max_top_cubes=None, level_key_gain=None,
        interpret=False, backend="mosaic", **overrides)
    return ops

  shapes = jax.eval_shape(operands, *(jax.ShapeDtypeStruct(s, d) for s, d in specs))
  leaves, treedef = jax.tree.flatten(shapes)
  fn = lambda *a: kernels.attend(*jax.tree.unflatten(treedef, a), static["cfg"],
                                 static["options"])
  return fn, [(l.shape, l.dtype) for l in leaves], flops


def _layer(name: str, dtype):
  """(fn(params, x), [param specs..., x], model FLOPs) for an NNX layer at LAYER's shape."""
  import jax
  from flax import nnx
  from neurips26_jax import models
  s = LAYER
  rngs = nnx.Rngs(0)
  layer = {"flash_ffn": lambda: models.FlashFFN(s["d"], impl="pallas", interpret=False,
                                                dtype=dtype, rngs=rngs),
           "swiglu": lambda: models.SwiGLU(s["d"], dtype=dtype, rngs=rngs)}[name]()
  graphdef, params = nnx.split(layer)
  leaves, treedef = jax.tree.flatten(params)
  specs = [(p.shape, p.dtype) for p in leaves] + [((s["b"], s["l"], s["d"]), dtype)]
  tokens = s["b"] * s["l"]
  # Matmul weights: every parameter but the norm gains (scale vectors) and the router's d x E
  # (~2 d E FLOPs per token, counted with the rest).
  weights = sum(p.size for p in leaves if p.ndim >= 2)

  def fn(*args):
    params = jax.tree.unflatten(treedef, args[:-1])
    return nnx.merge(graphdef, params)(args[-1])

  return fn, specs, 2 * tokens * weights, len(leaves) + 1


def _stirling_gammaln(x):
  """log Gamma(x) for x > 0 without a table lookup (jax's TPU lowering gathers, which libtpu's
  profiler rejects): Stirling's series at x + 6, shifted back by log x (x+1) ... (x+5);
  within 3e-6 of jax's for the FRAC exponents in (0, 2] (tests/test_step_estimate.py)."""
  import jax.numpy as jnp
  z = x + 6.0
  series = 1 / (12 * z) - 1 / (360 * z ** 3) + 1 / (1260 * z ** 5)
  shift = jnp.log(x * (x + 1) * (x + 2) * (x + 3) * (x + 4) * (x + 5))
  return (z - 0.5) * jnp.log(z) - z + 0.5 * math.log(2 * math.pi) + series - shift


def _lm_step_part(part: str, dtype, spec: dict, direction: str) -> Program:
  """One chip's share of a LanguageModel train step, for `step_estimate`: "mixer" or "ffn" (a
  half of one of its Blocks, x + mixer(norm1(x)) or x + ffn(norm2(x)), parameters float32 as
  stored: its forward, or with direction "bwd" its VJP alone from the forward's residuals),
  "block" (a whole Block, forward and VJP under the model's remat policy: what libtpu makes
  of the recomputation, fusion across the halves included, for blocks without a kernel),
  "attention_core" (see `_attention_core`) or "head" (final norm, LM head and the chunked
  loss on given features, forward and VJP).
  A Block is measured in halves, each kernel in a program of its own: libtpu's profiler
  rejected a FlashFFN block whose forward and backward kernels shared one (138 MiB of VMEM
  asked for; the real compiles fit). libtpu's profiler rejects gathers ("Unsupported DMA
  direction"): the embedding lookup is left out, the loss picks each label's logit by a
  one-hot sum (`train.losses._per_position` replaced in this process; same matmuls and
  softmax), and FRAC's mode weights take log-gamma from Stirling's series (`_stirling_gammaln`
  for jax.scipy.special.gammaln in this process: H values per layer). spec: config, mixer,
  ffn, context, batch (sequences per chip), remat (the model's policy; None: the config's).
  FLOPs: 2 x the part's parameters x tokens per forward."""
  import functools
  import types

  import jax
  import jax.numpy as jnp
  from flax import nnx

  from neurips26_jax import configs
  from neurips26_jax.models import LanguageModel
  from neurips26_jax.train import losses
  from neurips26_jax.train.losses import chunked_cross_entropy
  kwargs = dict(configs.load(spec["config"]).model.to_dict(), num_layers=1, impl="pallas")
  kwargs.update({k: spec[k] for k in ("mixer", "ffn", "context", "remat") if spec.get(k)})
  jax.scipy.special.gammaln = _stirling_gammaln
  model = nnx.eval_shape(lambda: LanguageModel(**kwargs, interpret=False, dtype=dtype,
                                               rngs=nnx.Rngs(0)))
  b, l, d = spec["batch"], kwargs["context"], kwargs["d_model"]
  if part == "attention_core":
    if direction != "fwd":
      raise ValueError("lmstep/attention_core: forward only (what remat='mixer' keeps out "
                       "of the recomputation)")
    return _attention_core(model.blocks[0].mixer, dtype, b, l, spec.get("heads"))
  halves = {"mixer": ("norm1", "mixer"), "ffn": ("norm2", "ffn")}
  split = ("mixer_pre", "mixer_out")
  in_block = part in ("block", *halves, *split)
  module = model.blocks[0] if in_block else model.norm
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  leaves, treedef = jax.tree.flatten(params)
  rest_leaves, rest_def = jax.tree.flatten(rest)
  n, m = len(leaves), len(rest_leaves)
  # arguments: the module's parameters, [the LM head,] the features x, its other state
  extra = [] if in_block else [(model.head.shape, model.head.dtype)]
  specs = ([(p.shape, p.dtype) for p in leaves] + extra + [((b, l, d), dtype)]
           + [(r.shape, r.dtype) for r in rest_leaves])
  k = n + len(extra)

  def apply(a):
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, a[:n]),
                     jax.tree.unflatten(rest_def, a[k + 1:k + 1 + m]))

  if part in split:
    if direction != "fwd":
      raise ValueError(f"lmstep/{part}: forward only (the VJP of the half is 'lmstep/mixer')")
    return _frac_forward_part(part, module, apply, specs, k, b * l)

  if part == "block":
    from neurips26_jax.models.lm import block_call
    block = lambda *a: block_call(model.remat, apply(a), a[k])
    weights = sum(math.prod(shape) for shape, _ in specs[:k])
    return _with_grad(block, specs, k + 1, 2 * b * l * weights, "", "fwd+bwd")
  if part in halves:
    # Differentiated: the half's own parameters and x. The other half's parameters are
    # arguments too, not differentiated: their gradients would be zeros the whole block's
    # program never writes (three broadcasts of SwiGLU's tables, 53K cycles, in the mixer
    # half's VJP at 125M).
    names = halves[part]
    paths = [path[0].key for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    own = [i for i, key in enumerate(paths) if key in names]
    other = [i for i, key in enumerate(paths) if key not in names]
    weights = sum(math.prod(specs[i][0]) for i in own)

    def half(*a):  # a: own parameters, x, the other parameters, the rest (k = n here)
      x, leaves = a[len(own)], [None] * n
      for i, value in zip(own + other, a[:len(own)] + a[len(own) + 1:n + 1]):
        leaves[i] = value
      norm, layer = (getattr(apply(leaves + [x, *a[n + 1:]]), name) for name in names)
      return x + layer(norm(x))

    half_specs = [specs[i] for i in own] + [specs[k]] + [specs[i] for i in other] + specs[k + 1:]
    return _with_grad(half, half_specs, len(own) + 1, 2 * b * l * weights, "", direction)
  weights = sum(math.prod(shape) for shape, _ in specs[:k])

  def one_hot_pick(logits, labels):
    picked = jnp.where(labels[..., None] == jnp.arange(logits.shape[-1]), logits, 0.0)
    ce = jax.nn.logsumexp(logits, -1) - jnp.sum(picked, -1)
    return ce, (jnp.argmax(logits, -1) == labels).astype(jnp.float32)

  losses._per_position = one_hot_pick

  def head(*a):
    # the model's own head (`LanguageModel.logits`) on the head weights passed in
    logits = functools.partial(LanguageModel.logits, types.SimpleNamespace(head=a[n]))
    return chunked_cross_entropy(apply(a)(a[k]), logits, a[-1], None)[0]

  return _with_grad(head, specs + [((b, l), jnp.int32)], k + 1, 2 * b * l * weights, "",
                    "fwd+bwd")


def _attention_core(mixer, dtype, batch: int, length: int, heads: int | None) -> Program:
  """The attention mixer's heads' outputs from their q, k, v (`models.attention.causal_heads`
  at the layer's query chunk): the part of the half's forward that remat="mixer" keeps
  (`step_estimate`). heads: profile that many of the layer's heads (the work is linear in
  heads; the query chunk stays the layer's). FLOPs: the causal half of q k^T and P v."""
  from neurips26_jax.models.attention import causal_heads, default_query_chunk
  d = mixer.wq.shape[-1]
  chunk = mixer.query_chunk or default_query_chunk(mixer.num_heads, length)
  spec = ((batch, length, heads or mixer.num_heads, d), dtype)
  flops = 2 * 2 * batch * spec[0][2] * d * length * (length + 1) // 2
  return Program(lambda q, k, v: causal_heads(q, k, v, chunk), [spec] * 3, flops,
                 _nbytes([spec] * 4), "")


def _frac_forward_part(part: str, block, apply, specs, k: int, tokens: int) -> Program:
  """A FRAC mixer half's forward without its scan, in two programs: "mixer_pre", norm1 and
  the layer up to the scan (`FRACMixer.scan_output`) with the scan replaced by a stand-in
  that returns its x, and "mixer_out", x + the gated norm and out_proj (`FRACMixer._output`)
  given the scan's outputs. `step_estimate` adds the scan op itself ("frac/kernel" at the
  layer's shape). libtpu's profiler fails the whole half ("Cannot schedule FIFO pop": the
  gated norm's reduction fused with the scan output's transpose to token-major) and runs out
  of this machine's memory on the layer's scan kernel at 4k tokens and 12 heads (> 24 GB);
  apart, the scan op's program writes y token-major, so the sum pays that transpose as a
  copy."""
  import types

  import jax
  from flax import nnx

  from neurips26_jax.models import frac
  weights = lambda module: sum(math.prod(p.shape) for p in
                               jax.tree.leaves(nnx.state(module, nnx.Param)))

  def pre(*a):
    blk = apply(a)
    table = frac.impl_table   # models.frac's name for the op table, swapped while tracing
    frac.impl_table = types.SimpleNamespace(call=lambda name, impl, x, *args, **kw: (x, None))
    try:
      return blk.mixer.scan_output(blk.norm1(a[k]))
    finally:
      frac.impl_table = table

  if part == "mixer_pre":
    pre_weights = weights(block.norm1) + weights(block.mixer) - math.prod(
        block.mixer.out_proj.shape)
    return Program(pre, specs, 2 * tokens * pre_weights, _nbytes(specs), "")
  outs = jax.eval_shape(pre, *(jax.ShapeDtypeStruct(s, d) for s, d in specs))
  out_specs = specs + [(o.shape, o.dtype) for o in outs]

  def output(*a):
    return a[k] + apply(a).mixer._output(*a[len(specs):])

  return Program(output, out_specs, 2 * tokens * math.prod(block.mixer.out_proj.shape),
                 _nbytes(out_specs), "")


PROGRAMS = {
    # name: (group, what it is)
    "flash_ffn/kernel": ("flash_ffn", "Pallas kernel (mhffn)"),
    "flash_ffn/xla": ("flash_ffn", "XLA path (512-token chunks, checkpointed)"),
    "flash_ffn/swiglu": ("flash_ffn", "XLA SwiGLU, FLOP-matched (d = H d_h, d_ff = E d_e)"),
    # Not compiled themselves: perf.PARTS sums the kernels' programs.
    "flash_ffn/kernels": ("flash_ffn", "the Mosaic kernels alone, inputs in their layout"),
    "flash_ffn/routed_kernels": ("flash_ffn", "the same with the head norm and router inside "
                                 "(mhffn_routed, as the layer runs them)"),
    "flash_ffn/fwd_kernel": ("flash_ffn", "the forward kernel alone (block sweep)"),
    "flash_ffn/bwd_kernel": ("flash_ffn", "the backward kernel alone (block sweep)"),
    "flash_ffn/routed_fwd_kernel": ("flash_ffn", "the routed forward kernel alone"),
    "flash_ffn/wide_kernels": ("flash_ffn", "the Mosaic kernels alone at d_h = 256 (H = 4, "
                               "the same FLOPs)"),
    "flash_ffn/wide_fwd_kernel": ("flash_ffn", "the forward kernel alone at d_h = 256"),
    "flash_ffn/wide_bwd_kernel": ("flash_ffn", "the backward kernel alone at d_h = 256"),
    "flash_ffn/routed_bwd_kernel": ("flash_ffn", "the routed backward kernel alone"),
    "flash_ffn/lm370frac_routed_kernels": ("flash_ffn", "the routed kernels at the 370M FRAC "
                                           "LM's tables (E = 9, d_e = 264)"),
    "flash_ffn/lm370frac_routed_fwd_kernel": ("flash_ffn", "its forward kernel alone"),
    "flash_ffn/lm370frac_routed_bwd_kernel": ("flash_ffn", "its backward kernel alone"),
    "frac/kernel": ("frac", "Pallas kernel (frac_scan)"),
    "frac/xla": ("frac", "XLA chunked path"),
    "pack3d/kernel": ("pack3d", "Pallas kernels (pack3d_attention)"),
    "pack3d/kernels": ("pack3d", "the Mosaic kernels alone, operands in their slot layout"),
    "pack3d/xla": ("pack3d", "XLA path"),
    "pack3d/dense": ("pack3d", "dense XLA attention"),
    "layer/flash_ffn": ("layer", "FlashFFN(1024) layer, kernel"),
    "layer/swiglu": ("layer", "SwiGLU(1024) layer"),
    "lmstep/mixer": ("lmstep", "a LanguageModel Block's mixer half, fwd (or its VJP: bwd)"),
    "lmstep/ffn": ("lmstep", "a LanguageModel Block's FFN half, fwd (or its VJP: bwd)"),
    "lmstep/head": ("lmstep", "a LanguageModel's final norm, head and loss, fwd + VJP"),
    "lmstep/mixer_pre": ("lmstep", "a FRAC mixer half's forward up to its scan (not in it)"),
    "lmstep/mixer_out": ("lmstep", "a FRAC mixer half's forward from the scan's output"),
    "lmstep/attention_core": ("lmstep", "an attention mixer's heads' outputs from q, k, v"),
    "lmstep/block": ("lmstep", "a whole Block, fwd + VJP under the model's remat (programs "
                     "without a kernel: libtpu's profiler rejects FlashFFN's and FRAC's)"),
}
KERNEL_PREFIX = {"flash_ffn": "flash_ffn", "frac": "frac_scan", "pack3d": "pack3d",
                 "layer": "flash_ffn"}


def build(name: str, direction: str, dtype_name: str, overrides: dict | None = None) -> Program:
  import jax.numpy as jnp
  dtype, overrides = jnp.dtype(dtype_name), dict(overrides or {})
  group, impl = name.split("/")
  if group == "lmstep":   # overrides: the model's spec (`_lm_step_part`), not block sizes
    return _lm_step_part(impl, dtype, overrides, direction)
  kernel = KERNEL_PREFIX[group] if impl in ("kernel", "flash_ffn") else ""
  if name.startswith("layer/"):
    fn, specs, flops, num_diff = _layer(impl, dtype)
    return _with_grad(fn, specs, num_diff, flops, kernel, direction)
  if name == "flash_ffn/swiglu":
    fn, specs, flops = _swiglu(dtype)
  elif name == "pack3d/kernels":
    fn, specs, flops = _pack3d_kernels(dtype, overrides)
    return _with_grad(fn, specs, 5, flops, KERNEL_PREFIX[group], direction)
  elif impl.endswith(("fwd_kernel", "bwd_kernel")):
    fn, specs, flops = _flash_ffn_kernel_only(impl, dtype, overrides)
    return Program(fn, specs, flops, _nbytes(specs), KERNEL_PREFIX[group])
  else:
    fn, specs, flops = {"flash_ffn": _flash_ffn, "frac": _frac, "pack3d": _pack3d}[group](
        impl, dtype, overrides)
  num_diff = {"flash_ffn": 5, "frac": 6, "pack3d": 3}[group]
  return _with_grad(fn, specs, num_diff, flops, kernel, direction)
