"""Device mesh from the config, parameter and batch shardings, multi-host start-up.

config.mesh = {data, fsdp, tensor}: sizes of the mesh axes; one of them may be -1 (fills the
rest). The product must divide the device count; the mesh takes the first `product` devices.
Logical axis names and their mapping are in `models.partitioning`.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.partitioning import BATCH_AXES, MESH_AXES, param_logical_axes, spec_for
from train.errors import UsageError


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


def param_shardings(model, params, mesh: Mesh):
  """NamedShardings (same tree as `params` = nnx.state(model, nnx.Param)) from the logical axes."""
  axes = param_logical_axes(model)

  def one(path, x):
    keys = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path
                 if not isinstance(k, jax.tree_util.GetAttrKey))
    return NamedSharding(mesh, spec_for(axes[keys], x.shape, mesh))

  return jax.tree_util.tree_map_with_path(one, params)


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


def initialize_distributed(coordinator_address: str, num_processes: int | None,
                           process_id: int | None) -> None:
  """jax.distributed.initialize when a coordinator is given (multi-host); no-op otherwise."""
  if coordinator_address:
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
