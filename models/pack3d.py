"""Pack3D attention as a Flax NNX layer: y = layer(x, coords, field_ids), x [B, N, d]."""

from __future__ import annotations

from typing import Any, Literal, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

from neurips26_jax.jaxops import checks
from neurips26_jax.jaxops import pack3d_levels as levels_lib
from neurips26_jax.jaxops import rope
from neurips26_jax.models import impl as impl_table
from neurips26_jax.models.impl import Impl, resolve_impl
from neurips26_jax.models.partitioning import param

Position = Literal["axial_rope", "learned_packed", "rope_packed", "none"]
_POSITIONS = ("axial_rope", "learned_packed", "rope_packed", "none")


class Pack3DAttention(nnx.Module):
  """Local + cube-summary attention over packed 3D token grids (DESIGN.md section 3).

  x [B, N, d] -> q, k, v = x W_qkv split into H heads [B, N, H, D] -> positions ->
  Pack3D attention (`jaxops.pack3d`) over (coords, field_ids) -> concat heads -> W_out
  -> y [B, N, d]. coords int [B, N, 3] (z, y, x) of each token in its field, field_ids
  int [B, N]; tokens in any order.

  Position modes:
    "axial_rope"      axial 3D RoPE of q, k on the grid coordinates, before compression
                      (invariant to the packing order; D % 6 == 0)
    "learned_packed"  learned absolute embedding of the packed index added to x
                      (needs `max_len` >= N); a baseline that depends on the packing order
    "rope_packed"     1D RoPE of q, k over the packed index (baseline)
    "none"            no positions

  Args:
    d_model, num_heads: d and H (head dim D = d / H).
    block_shape, radius_blocks: the cube shape and the local radius in cubes.
    impl: "auto" (default), "pallas" (kernel), "xla" (cube-gather XLA path) or "reference"
      (dense); see `models.impl`. "auto" with merge "gated" or "local" is "xla".
    interpret: passed to the Pallas kernel (None: interpret on CPU only).
    backend: force a kernel body, "mosaic", "triton" or "mosaic_gpu" (None: the dispatch's
      choice per chip and dtype; README's table); `models.impl.kernel_body(layer, ...)` says
      which body a call runs.
    merge: "joint" (one softmax over both branches), "gated" (NSA-style: per-head
      sigmoid gates from x weight two separately normalized branches; XLA/reference only)
      or "local" (the local branch alone, no far summaries: the local-only ablation;
      computed as the gated merge with gates (1, 0), so it costs what "gated" does).
    rotate_summaries: "before" compression (default) or "after" (the ablation; axial_rope).
    max_cubes: cube slots when coords are traced (see `jaxops.pack3d_layout`).
    far_offset: learn a per-head offset beta_h on the far-summary logits,
      s_ib = q_i . kbar_b / sqrt(D) + log(n_b) + beta_h (the parameter `far_offset` [H],
      logical axis "heads"). It starts at 0, so at init the bias is the paper's log(n_b) and
      a cube of identical keys still counts as its n_b tokens; training can then move each
      head's far-vs-local balance. A vector, so never weight-decayed (`train.optim`).
      Off by default: the paper's fixed bias stays the default unless an experiment shows the
      offset trains better, and on the far-context task it did not (object accuracy +0.001,
      95% interval [-0.003, +0.006] over 3 seeds; the repository's RESULTS.md section 5).
      With merge "gated" the offset cancels inside the separately normalized far branch (no
      effect, gradient 0); with "local" there is no far branch.
    levels, level_radius: the multi-level far field (DESIGN.md section 3.1): levels = 1 (the
      default) is the paper's single level; with levels >= 2 farther cubes are summarized by
      coarser cubes (level k: 2^(k-1) block_shape per axis), level_radius the radii r_2..r_L
      (None: radius_blocks). The XLA path and the kernels (which still visit every summary
      block: exact, but near-linear only on the XLA path); one far offset per head shared by
      the levels. Why levels = 1 is the default: it is the paper's field, exact by the
      counting argument, and a level-k summary averages 8^(k-1) cubes, so one distant cube's
      feature is diluted 8^(k-1)-fold there (`level_key_gain` gives it back its logit, not its
      resolution): use levels >= 2 where one level's N^2 / prod(block_shape) far term does
      not fit (DESIGN.md section 3.1).
    max_top_cubes: with levels >= 2 and traced coords, the top level's cube slots (see
      `jaxops.pack3d.pack3d_attention`; None: max_cubes, exact for any layout but quadratic
      in the top level). Set it from your grids to keep the far field near-linear.
    level_key_gain: g, with levels >= 2: level-k summary keys are scaled by g^(k-1), so their
      logits are g^(k-1) q . kbar_b / sqrt(D) + log(n_b). None: 8, the rule: a level-k cube
      holds 8^(k-1) level-1 cubes, so 8^(k-1) gives a feature that fills one of them back the
      key term of its own level-1 summary's logit (with g = 1 two levels never learned the
      far-context task's distant marker; DESIGN.md section 3.1 has the measurement). 1 keeps
      the counting argument exact (a cube of identical keys counts as its n_b tokens).
    dtype: compute dtype (params are cast to it); None uses the input's dtype.
  """

  def __init__(self, d_model: int, num_heads: int, *, block_shape: Sequence[int] = (4, 4, 4),
               radius_blocks: int = 1, position: Position = "axial_rope", impl: Impl = "auto",
               interpret: Any = None, backend: str | None = None, max_len: int | None = None,
               block_bias: bool = True,
               merge: str = "joint", rotate_summaries: str = "before", rope_theta: float = 10000.0,
               spacing: Sequence[float] = (1.0, 1.0, 1.0), max_cubes: int | None = None,
               far_offset: bool = False, levels: int = 1,
               level_radius: int | Sequence[int] | None = None,
               max_top_cubes: int | None = None, level_key_gain: float | None = None,
               dtype: DTypeLike | None = None,
               param_dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs) -> None:
    owner = "Pack3DAttention"
    checks.ints(owner, dict(d_model=d_model, num_heads=num_heads,
                            **checks.given(max_len=max_len, max_cubes=max_cubes,
                                           max_top_cubes=max_top_cubes)))
    checks.ints(owner, {"radius_blocks": radius_blocks}, minimum=0)
    checks.zyx(owner, "block_shape", block_shape)
    checks.multiple(owner, "`d_model`", d_model, num_heads, "`num_heads`")
    head_dim = d_model // num_heads
    checks.one_of(owner, "position", position, _POSITIONS)
    if position == "axial_rope" and head_dim % 6:
      raise ValueError(f"Pack3DAttention: axial_rope needs the head dim (d_model / num_heads ="
                       f" {head_dim}) divisible by 6")
    if position == "rope_packed" and head_dim % 2:
      raise ValueError(f"Pack3DAttention: rope_packed needs an even head dim, got {head_dim}")
    if position == "learned_packed" and not max_len:
      raise ValueError("Pack3DAttention: position='learned_packed' needs `max_len`")
    checks.one_of(owner, "merge", merge, ("joint", "gated", "local"))
    if merge in ("gated", "local") and impl == "pallas":
      raise ValueError(f"Pack3DAttention: merge={merge!r} needs impl='xla' or 'reference'")
    checks.one_of(owner, "rotate_summaries", rotate_summaries, ("before", "after"))
    if rotate_summaries == "after" and position != "axial_rope":
      raise ValueError("Pack3DAttention: rotate_summaries='after' needs position='axial_rope'")
    levels_lib.level_radii(radius_blocks, levels, level_radius)
    if levels > 1 and (impl == "reference" or merge != "joint" or rotate_summaries != "before"):
      raise ValueError(f"Pack3DAttention: levels={levels} needs impl 'auto', 'xla' or 'pallas', "
                       f"merge 'joint' and rotate_summaries 'before' (got impl={impl!r}, merge="
                       f"{merge!r}, rotate_summaries={rotate_summaries!r})")
    self.num_heads, self.head_dim = num_heads, head_dim
    self.position, self.merge = position, merge
    self.impl = resolve_impl(owner, impl, has_kernel=merge == "joint", backend=backend)
    self.interpret, self.backend = interpret, backend
    self.rope = dict(theta=rope_theta, spacing=tuple(spacing))
    self.op_kwargs = dict(block_shape=tuple(block_shape), radius_blocks=radius_blocks,
                          block_bias=block_bias,
                          summary_rope=self.rope if rotate_summaries == "after" else None)
    levels_lib.check_level_options(levels, max_top_cubes, level_key_gain, owner=owner)
    if levels > 1:
      self.op_kwargs.update(levels=levels, level_radius=level_radius, max_top_cubes=max_top_cubes,
                            level_key_gain=level_key_gain)
    self.max_cubes, self.dtype = max_cubes, dtype
    xavier = jax.nn.initializers.xavier_uniform()
    # logical axes (models.partitioning): w_qkv [d, 3, H d_h] holds q, k, v, head-major
    # ("heads", split over "tensor"; drawn as one [d, 3d] matrix), w_out's rows are the H d_h
    # head channels ("heads")
    self.w_qkv = param(xavier(rngs.params(), (d_model, 3 * d_model), param_dtype).reshape(
        d_model, 3, d_model), "embed", None, "heads", cast=True)
    self.w_out = param(xavier(rngs.params(), (d_model, d_model), param_dtype), "heads", "embed",
                       cast=True)
    self.pos_embedding = (param(jax.nn.initializers.normal(0.02)(
        rngs.params(), (max_len, d_model), param_dtype), None, "embed", cast=True)
        if position == "learned_packed" else None)
    self.w_gate = (param(xavier(rngs.params(), (d_model, 2 * num_heads), param_dtype),
                         "embed", "heads", cast=True) if merge == "gated" else None)
    self.far_offset = (param(jnp.zeros((num_heads,), param_dtype), "heads")
                       if far_offset else None)

  def _attend(self, q, k, v, coords, field_ids, gates):
    # the local heads' offsets under partitioning.shard_layer(split_heads=True), else all H
    kwargs = dict(self.op_kwargs, far_offset=None if self.far_offset is None
                  else self.far_offset[...].astype(jnp.float32))
    return impl_table.call("pack3d", self.impl, q, k, v, coords, field_ids, gates=gates,
                           max_cubes=self.max_cubes, interpret=self.interpret,
                           backend=self.backend, **kwargs)

  def __call__(self, x: jax.Array, coords: ArrayLike, field_ids: ArrayLike) -> jax.Array:
    """x [B, N, d], coords int [B, N, 3], field_ids int [B, N] -> [B, N, d] (compute dtype)."""
    d_model = self.w_qkv.shape[0]
    checks.sequence("Pack3DAttention", "x", x, d_model)
    dtype = self.dtype or x.dtype
    batch, n = x.shape[:2]
    x = x.astype(dtype)
    if self.position == "learned_packed":
      if n > self.pos_embedding.shape[0]:
        raise ValueError(f"Pack3DAttention: `x` has N={n} tokens, more than max_len="
                         f"{self.pos_embedding.shape[0]}")
      x = x + self.pos_embedding[:n].astype(dtype)
    # the local heads under partitioning.shard_layer(split_heads=True), else all H
    w_qkv = self.w_qkv[...].astype(dtype)
    qkv = (x @ w_qkv.reshape(d_model, -1)).reshape(batch, n, 3, -1, self.head_dim)
    heads = qkv.shape[3]
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if self.position == "axial_rope":
      q, k = (rope.axial_rope_3d(t, coords, **self.rope) for t in (q, k))
    elif self.position == "rope_packed":
      index = jnp.broadcast_to(jnp.arange(n), (batch, n))
      q, k = (rope.rope_1d(t, index, theta=self.rope["theta"]) for t in (q, k))
    gates = None
    if self.merge == "gated":
      gates = jax.nn.sigmoid(x @ self.w_gate[...].astype(dtype)).reshape(batch, n, heads, 2)
    elif self.merge == "local":
      gates = jnp.broadcast_to(jnp.asarray([1.0, 0.0], dtype), (batch, n, heads, 2))
    o = self._attend(q, k, v, coords, field_ids, gates)
    return o.reshape(batch, n, -1) @ self.w_out[...].astype(dtype)
