"""Device mesh from the config, parameter and batch shardings (multi-host start-up is
train.distributed).

config.mesh = {data, fsdp, tensor}: sizes of the mesh axes; one of them may be -1 (fills the
rest). The product must divide the device count; the mesh takes the first `product` devices.

Parameters carry their logical axis names as metadata (`models.partitioning.param`, the
`out_sharding` metadata of `nnx.with_partitioning`); `RULES` (defined beside the models, which
also constrain activations with it) maps them onto the mesh:

  batch -> (data, fsdp); embed, expert_mlp, head_dim -> fsdp; heads, mlp, vocab -> tensor;
  channels (norm gains, biases) -> (fsdp, tensor); a dimension they do not divide is replicated.

So each parameter is held once across an fsdp x tensor group and replicated over data only.
`init_sharded` creates a model's parameters directly in that layout, under `jax.jit`.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import optax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from flax import nnx

from neurips26_jax.models.partitioning import (  # noqa: F401
    BATCH_AXES, MESH_AXES, RULES, logical_axes, spec_for)
from neurips26_jax.train.errors import UsageError


def mesh_shape(mesh_config, num_devices: int) -> tuple[int, ...]:
  """Axis sizes for MESH_AXES with -1 filled in; UsageError naming the config field otherwise."""
  sizes = [mesh_config[a] for a in MESH_AXES]
  for axis, size in zip(MESH_AXES, sizes):
    if not isinstance(size, int) or (size < 1 and size != -1):
      raise UsageError(f"config.mesh.{axis} must be a positive int or -1, got {size!r}")
  if sizes.count(-1) > 1:
    raise UsageError(f"config.mesh: at most one axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
  known = math.prod(s for s in sizes if s != -1)
  if num_devices % known:
    field = next((a for a, s in zip(MESH_AXES, sizes) if s != 1 and s != -1), MESH_AXES[0])
    raise UsageError(f"config.mesh.{field}: mesh {dict(zip(MESH_AXES, sizes))} (product {known}) "
                     f"does not divide the {num_devices} devices; expected axis sizes whose "
                     f"product divides {num_devices} (-1 on one axis fills the rest)")
  return tuple(num_devices // known if s == -1 else s for s in sizes)


def make_mesh(mesh_config) -> Mesh:
  shape = mesh_shape(mesh_config, jax.device_count())
  devices = np.asarray(jax.devices()[:math.prod(shape)]).reshape(shape)
  return Mesh(devices, MESH_AXES)


def state_shardings(state, mesh: Mesh):
  """NamedShardings (same tree as the nnx.State `state`, concrete or abstract): by each
  variable's logical axes through RULES; variables without any (and non-Param state) are
  replicated."""
  def one(variable):
    return variable.replace(NamedSharding(mesh, spec_for(logical_axes(variable),
                                                         variable.shape, mesh)))

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def optimizer_shardings(tx, params, mesh: Mesh):
  """NamedShardings of tx.init(params): each parameter-shaped part of the state (AdamW's mu
  and nu) sharded as its parameter, the rest (step counts) replicated. Without them jit
  places tx.init's zeros as it likes, and it replicated the whole optimizer state on every
  device (2/3 of a ZeRO-sharded train state: 1.0 of 1.05 GiB per chip for a 135M model on
  16 chips, the repository's benchmarks/aot/scale.py)."""
  param_shardings = jax.tree.map(lambda x: x.sharding, params)
  return optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, params),
                               param_shardings,
                               transform_non_params=lambda _: NamedSharding(mesh, P()))


def init_sharded(make_model: Callable[[], nnx.Module], mesh: Mesh) -> nnx.Module:
  """make_model() with every parameter created already sharded over `mesh`.

  The flax pattern: nnx.eval_shape for the shapes and logical axes (nothing allocated), then
  the constructor runs under jax.jit with out_shardings from them, so each device only ever
  holds its own shards (no eager single-device initialisation). Arguments errors of the
  constructor surface from the eval_shape, as they would eagerly. The random streams are the
  same as an eager construction's (partitionable PRNG), so the values do not depend on the mesh.
  """
  abstract = nnx.eval_shape(make_model)
  graphdef, abstract_state = nnx.split(abstract)
  shardings = state_shardings(abstract_state, mesh)
  init = jax.jit(lambda: nnx.split(make_model())[1], out_shardings=shardings)
  with jax.set_mesh(mesh):
    state = init()
  return nnx.merge(graphdef, state)


def put_batch(batch: dict, mesh: Mesh) -> dict:
  """Global host batch {name: np [B, ...]} -> jax arrays split over BATCH_AXES along B.

  Every process builds the same global batch (batches are pure functions of the step) and
  contributes the slices its devices hold, so this works unchanged on many hosts.
  """
  def put(x):
    x = np.asarray(x)
    sharding = NamedSharding(mesh, P(BATCH_AXES))
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  return {k: put(v) for k, v in batch.items()}

