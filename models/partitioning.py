"""Logical axis names for parameters and activations, and their mapping onto the mesh.

The mesh has three axes, ("data", "fsdp", "tensor"). Every parameter of the models in `models/`
carries its own logical axis names, one per dimension, as metadata (`param(value, *names)`: the
`out_sharding` metadata of `nnx.with_partitioning`); activations are constrained with
`constrain(x, names)`. `RULES` maps a logical name to mesh axes:

  batch                   -> ("data", "fsdp")   batch split over data * fsdp
  embed, expert_mlp,      -> "fsdp"             parameters sharded (ZeRO-3 style) over fsdp
    head_dim
  vocab, heads, mlp       -> "tensor"           tensor parallelism (Megatron-style column/row)
  head_channels           -> ("tensor", "fsdp") per-channel vectors laid out head-major (H P):
                                                tensor-major, so a tensor shard is whole heads
  channels                -> ("fsdp", "tensor") per-channel vectors (norm gains, biases)
  act_heads, act_vocab    -> "tensor"
  anything else           -> replicated

A dimension that the mapped mesh axes do not divide, or whose mesh axis an earlier dimension
already uses, stays replicated, so any shape is legal. Parameters without names are replicated.

Pallas kernels cannot be auto-partitioned, so layers that call one run through `shard_layer`:
under `jax.shard_map` with the batch split over ("data", "fsdp"), so the kernels of FlashFFN,
FRAC and Pack3D run on the local heads and batch; their outputs are sums of per-head terms,
added up after the map. Every parameter enters the map in its own layout and is gathered
inside it, over every mesh axis but "tensor" on its head dimensions ("heads",
"head_channels"); one marked `cast` (a weight the layer reads in its compute dtype) is cast
before it is gathered, so in bf16 the gather moves and holds half the bytes. Gathered inside
the (rematerialised) block, a layer's whole weights live only while it runs, and their
gradients leave the map reduce-scattered, before the layer below starts its backward
(`_reduced_in_order`).
With no mesh in context (`jax.set_mesh`) every helper here is the identity.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

RULES: dict[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,
    "embed": ("fsdp",),
    "expert_mlp": ("fsdp",),
    "head_dim": ("fsdp",),
    "channels": ("fsdp", "tensor"),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "head_channels": ("tensor", "fsdp"),
    "mlp": ("tensor",),
    "act_heads": ("tensor",),
    "act_vocab": ("tensor",),
}

def spec_for(names: Sequence[str | None], shape: Sequence[int], mesh) -> P:
  """PartitionSpec for an array of `shape` whose dimensions carry logical `names`."""
  if len(names) != len(shape):
    raise ValueError(f"logical axes {tuple(names)} do not match shape {tuple(shape)}")
  used, spec = set(), []
  for name, size in zip(names, shape):
    axes = tuple(a for a in RULES.get(name, ()) if a in mesh.shape and a not in used)
    if axes and size % math.prod(mesh.shape[a] for a in axes) == 0:
      used.update(axes)
      spec.append(axes if len(axes) > 1 else axes[0])
    else:
      spec.append(None)
  return P(*spec)


def param(value: jax.Array, *names: str | None, cast: bool = False) -> nnx.Param:
  """nnx.Param carrying its logical axis `names` (one per dimension) as `out_sharding` metadata,
  the metadata `nnx.with_partitioning` sets (read back by `nnx.get_partition_spec`).

  `cast=True` marks a weight that its layer reads in the layer's compute dtype (it casts it
  before every use): `shard_layer` then casts it before gathering it.

  The names are logical, so flax's eager sharding is off for them (`eager_sharding=False`): the
  layer builds the same with or without a mesh, and `train.sharding.init_sharded` maps the
  names onto the mesh with `RULES` when it creates the parameters under `jax.jit`.
  """
  if len(names) != jnp.ndim(value):
    raise ValueError(f"logical axes {names} do not match shape {jnp.shape(value)}")
  variable = nnx.Param(value, **axes_metadata(*names))
  if cast:
    variable.set_metadata("cast", True)
  return variable


def scale(value: jax.Array, *names: str | None) -> nnx.Param:
  """A scale parameter (a norm gain, or any multiplier that starts at 1): `param`, marked so
  that the optimizer never weight-decays it whatever its rank (`train.optim.decay_mask`);
  decay would pull it towards 0, not towards the identity it starts at."""
  variable = param(value, *names)
  variable.set_metadata("weight_decay", False)
  return variable


def axes_metadata(*names: str | None) -> dict:
  """The metadata `param` sets, for flax layers that take it (`kernel_metadata=`,
  `bias_metadata=` of nnx.Conv, nnx.Linear, ...)."""
  return {"out_sharding": tuple(names), "eager_sharding": False}


def logical_axes(variable: nnx.Variable) -> tuple:
  """The logical axis names of `variable` (its `out_sharding` metadata); all None (replicated)
  for a variable without them."""
  names = variable.get_metadata("out_sharding", None)
  return tuple(names) if names else (None,) * variable.ndim


def _active_mesh():
  """The context mesh, or None without one, with one device, or inside a shard_map."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1 or jax.sharding.AxisType.Manual in mesh.axis_types:
    return None
  return mesh


def is_split(variable: nnx.Variable) -> bool:
  """Whether the context mesh splits `variable` over devices (by its logical axes and `RULES`):
  such a parameter is gathered where it is used whole."""
  mesh = _active_mesh()
  return mesh is not None and any(spec_for(logical_axes(variable), variable.shape, mesh))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """with_sharding_constraint by logical names under the context mesh; identity without one."""
  mesh = _active_mesh()
  if mesh is None:
    return x
  return jax.lax.with_sharding_constraint(x, spec_for(names, x.shape, mesh))


HEAD_AXES = ("heads", "head_channels")


def _axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _splits_heads(variable: nnx.Variable, tensor: int) -> bool:
  """Whether "tensor" divides every head dimension (HEAD_AXES) of `variable`."""
  return all(size % tensor == 0 for n, size in zip(logical_axes(variable), variable.shape)
             if n in HEAD_AXES)


def _entry_layout(variable: nnx.Variable, mesh, local_heads: bool) -> tuple[P, P]:
  """(spec it enters shard_map with, spec it keeps inside) for a parameter of `shard_layer`.

  It enters in its own layout (`spec_for`), and inside is gathered over all of it but, with
  `local_heads`, "tensor" on its head dimensions (which it then must carry: a head dimension
  that "head_channels" leaves whole because fsdp x tensor does not divide it enters split over
  "tensor" alone, a slice of the whole)."""
  names = logical_axes(variable)
  enter = list(spec_for(names, variable.shape, mesh))
  keep = [None] * len(names)
  if local_heads:
    for i, name in enumerate(names):
      if name in HEAD_AXES:
        if "tensor" not in _axes(enter[i]):
          enter[i] = "tensor"
        keep[i] = "tensor"
  return P(*enter), P(*keep)


def _gather(value: jax.Array, enter: P, keep: P) -> jax.Array:
  """Inside shard_map: the local block of a parameter laid out as `enter`, gathered over every
  mesh axis of it that `keep` does not name. A dimension split over several axes is gathered
  over them in the spec's order, which is the order of its blocks (major axis first)."""
  for dim, (entered, kept) in enumerate(zip(enter, keep)):
    axes = tuple(a for a in _axes(entered) if a not in _axes(kept))
    if axes:
      value = jax.lax.all_gather(value, axes, axis=dim, tiled=True)
  return value


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _reduced_in_order(fn, *args):
  """fn(*args), whose backward hands back the cotangents of all `args` together, behind one
  optimization barrier: x's cotangent, which the layer below needs for its own backward, waits
  for this layer's parameter gradients to be reduced. Without it XLA's combiner merges every
  layer's gradient reduction into one collective at the end of the backward (on v5e the
  reduce-scatters become all-reduces), holding every layer's whole gradients until then."""
  return fn(*args)


def _reduced_in_order_fwd(fn, *args):
  return jax.vjp(fn, *args)


def _reduced_in_order_bwd(fn, vjp, dy):
  return jax.lax.optimization_barrier(vjp(dy))


_reduced_in_order.defvjp(_reduced_in_order_fwd, _reduced_in_order_bwd)


def psum_heads(x: jax.Array) -> jax.Array:
  """Sum of x over the "tensor" axis, for a statistic over all heads computed inside
  `shard_layer(split_heads=True)` from the local ones (FRAC's gated norm).

  Its transpose is again a sum over "tensor" (shard_map with check_vma=False), which is the
  gradient wanted here: every device's local heads feed every device's output.
  """
  return jax.lax.psum(x, "tensor")


def shard_layer(layer: nnx.Module, x: jax.Array, *extra: jax.Array, split_seq: bool = False,
                split_heads: bool = False):
  """layer(x, *extra) under jax.shard_map when a mesh is active (for Pallas-kernel layers).

  x [B, L, ...] and every `extra` [B, ...] are split over BATCH_AXES along B. Every parameter
  enters in its own layout and is gathered inside the map (after a cast to the layer's compute
  dtype, `layer.dtype` or x's, if marked `cast`); the gathers' transposes reduce-scatter the
  gradients, a cast weight's in the compute dtype (as XLA's partitioner reduces the bf16
  gradients of the weights it gathers for the attention and SwiGLU layers), and x's cotangent
  waits for them (`_reduced_in_order`). With `split_heads` (layers whose parameters name their head dimensions
  (HEAD_AXES) in head-major blocks, and whose output is the sum of per-head terms: FlashFFN,
  FRAC, Pack3D), the head dimensions stay split over "tensor", so the layer and its kernel run
  on the local heads (a layer reads its local head count from its parameters' shapes); the
  per-device partial outputs are summed after the map. Otherwise (or when "tensor" does not
  divide the heads) parameters are gathered whole, and with `split_seq` (token-wise layers
  only) x is also split over "tensor" along L. The output has x's layout.
  """
  mesh = _active_mesh()
  if mesh is None:
    return layer(x, *extra)
  graphdef, state = nnx.split(layer)
  x_spec = spec_for(("batch", "seq") + (None,) * (x.ndim - 2), x.shape, mesh)
  extra_specs = tuple(P(x_spec[0]) for _ in extra)
  tensor = mesh.shape["tensor"]
  is_var = lambda v: isinstance(v, nnx.Variable)
  variables, treedef = jax.tree.flatten(state, is_leaf=is_var)
  local_heads = split_heads and tensor > 1 and all(_splits_heads(v, tensor) for v in variables)
  layouts = [_entry_layout(v, mesh, local_heads) for v in variables]
  dtype = getattr(layer, "dtype", None) or x.dtype

  def run(state, x, *extra):
    local = jax.tree.leaves(state, is_leaf=is_var)
    whole = [v.replace(_gather(v[...].astype(dtype) if v.get_metadata("cast", False)
                               else v[...], *layout)) for v, layout in zip(local, layouts)]
    return nnx.merge(graphdef, treedef.unflatten(whole))(x, *extra)

  state_specs = treedef.unflatten([v.replace(enter) for v, (enter, _) in zip(variables, layouts)])
  if local_heads:
    # [tensor, B, L, ...] partial sums, one per head group, added up outside the map (with
    # check_vma=False a psum inside would be transposed to a second psum)
    partial = jax.shard_map(lambda *a: run(*a)[None], in_specs=(state_specs, x_spec)
                            + extra_specs, out_specs=P("tensor", *x_spec), check_vma=False)
    return _reduced_in_order(partial, state, x, *extra).sum(0)
  if split_seq and x.shape[1] % tensor == 0:
    x_spec = P(x_spec[0], "tensor", *x_spec[2:])
  return _reduced_in_order(jax.shard_map(run, in_specs=(state_specs, x_spec) + extra_specs,
                                         out_specs=x_spec, check_vma=False), state, x, *extra)
