"""The chips the kernels must compile for, and how to describe each one without hardware.

TPU: `jax.experimental.topologies.get_topology_desc` with libtpu installed builds a
topology from its name; a 1x1 topology is rejected, so a 2x2 one is made and one chip used.
GPU: XLA's `GpuTargetConfig` text protos (copied from openxla/xla
`xla/backends/gpu/target_config/specs`, less `collective_memory_granularity`, which jaxlib
0.10.2 does not parse; 0.12 reads them as they are) give the CUDA plugin the device it
compiles for; Pallas reads the compute capability from the GPU model named in their
`device_description_str`; `shared_memory_per_block_optin` is the per-block shared-memory
limit a kernel must fit (b200.txtpb: XLA's public B200 spec, compute capability 10.0).
On Hopper and Blackwell targets (jax >= 0.12) bfloat16 FlashFFN compiles as a Mosaic GPU
kernel (WGMMA; tcgen05 on Blackwell), and on Hopper Pack3D and FRAC do too: Mosaic turns
it into PTX and runs ptxas during XLA's compile, and checks its shared memory against the
limit set with `artificial_shared_memory_limit` (see worker.py).
"""

from __future__ import annotations

import dataclasses
import pathlib

_SPECS = pathlib.Path(__file__).parent / "targets"


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  kind: str          # "tpu" or "gpu"
  spec: str          # TPU topology name, or the GPU target-config file name
  # The per-kernel on-chip memory limit the compiler enforces: shared memory per block
  # (GPU); default scoped VMEM (TPU; raise it with CompilerParams(vmem_limit_bytes=...)).
  on_chip_limit: int
  # The tensor cores of the Mosaic GPU kernels that compile for it: "hopper" (WGMMA: every
  # op's), "blackwell" (tcgen05 and tensor memory: FlashFFN's); "" for none.
  generation: str = ""

  @property
  def mosaic_gpu(self) -> bool:
    """Whether some op compiles as a Mosaic GPU kernel for this target."""
    return bool(self.generation)

  @property
  def venv(self) -> str:
    """The virtualenv that holds this kind's compiler (see the Makefile)."""
    return f".venv-aot-{self.kind}"


TARGETS = {t.name: t for t in (
    Target("tpu-v5e", "tpu", "v5e:2x2", 16 * 2**20),
    Target("tpu-v6e", "tpu", "v6e:2x2", 32 * 2**20),
    Target("gpu-a100", "gpu", "a100_sxm_80.txtpb", 166_912),
    Target("gpu-h100", "gpu", "h100_sxm.txtpb", 232_448, generation="hopper"),
    Target("gpu-h200", "gpu", "h200.txtpb", 232_448, generation="hopper"),
    Target("gpu-b200", "gpu", "b200.txtpb", 232_448, generation="blackwell"),
)}


def environment(target: Target) -> dict:
  """Environment variables the worker needs before it imports jax."""
  env = {"JAX_PLATFORMS": "cpu"}
  if target.kind == "tpu":
    env["TPU_SKIP_MDS_QUERY"] = "1"       # no GCE metadata server to wait for
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # several compiles at once (no chip to share)
  else:
    env["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"   # no CUDA driver to check
    env["TF_CPP_MIN_LOG_LEVEL"] = "0"              # ptxas -v report on stderr
    env["TF_CPP_VMODULE"] = "subprocess_compilation=3"
    # Mosaic GPU kernels: ptxas' report and the resources (shared memory) of each kernel go
    # to files under MOSAIC_GPU_DUMP_TO, which the worker sets per case.
  return env


def device_mesh(target: Target):
  """A one-chip jax Mesh on the described target (call inside the target's venv)."""
  import numpy as np
  from jax.experimental import topologies
  from jax.sharding import Mesh

  if target.kind == "tpu":
    topo = topologies.get_topology_desc(topology_name=target.spec, platform="tpu")
  else:
    config = (_SPECS / target.spec).read_text()
    topo = topologies.get_topology_desc(target.spec.split(".")[0], "cuda",
                                        target_config=config, topology="1x1x1")
  return Mesh(np.array(topo.devices[:1]), ("chip",))


def temp_bytes_on(target: Target):
  """(spec, temp) for memory measurements on one chip of `target` (call in the target's venv
  with its `environment` set): spec(shape, dtype) is an abstract argument placed on it, and
  temp(fn, *specs) XLA's temp_size_in_bytes of jit(fn) compiled for it (the kernels tiled
  for that chip)."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec

  from neurips26_jax.pallas_kernels.dispatch import target_chip

  mesh = device_mesh(target)
  sharding = NamedSharding(mesh, PartitionSpec())

  def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

  def temp(fn, *arg_specs):
    with target_chip(target.name), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return jax.jit(fn).lower(*arg_specs).compile().memory_analysis().temp_size_in_bytes

  return spec, temp
