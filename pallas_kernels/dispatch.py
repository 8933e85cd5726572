"""Shared by every kernel's entry point: pick the lowering for the platform and the tiles
for the chip.

Each op has a Mosaic (TPU) and a Triton (GPU) kernel body, and a Mosaic GPU one (jax >=
0.11.2: TMA, and WGMMA on Hopper or tcgen05 on Blackwell, `mosaic_gpu_common`). Its public
function builds a `KernelConfig` from its keyword arguments and runs its forward and
backward through `dispatch`, which uses `jax.lax.platform_dependent` so that one jitted
function runs interpreted on CPU and compiles for TPU and GPU. On a CUDA GPU the kernel
body is chosen per chip when the program is traced (`gpu_backend`): Mosaic GPU where its
body serves the generation (Hopper, compute capability 9.x, for every op; Blackwell, 10.x,
for the ops listed with it) and was measured faster than Triton on such a chip
(`MEASURED_FASTER`), Triton otherwise.

Block sizes come from each op's table of tuned entries, keyed by (backend, chip, dtype)
(levanter's `tuned_block_sizes`); every entry is compiled by `make compile-check` for its
chip. The chip is read from `jax.devices()` when the program runs on a TPU or GPU; a
deviceless compile (the repository's benchmarks/aot) names it with `target_chip`. An unknown
chip gets the backend's generic entry, which is the smallest chip's (A100, v5e) and so fits
them all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp

from neurips26_jax.jaxops import checks

Backend = Literal["mosaic", "triton", "mosaic_gpu"]
BACKENDS = ("mosaic", "triton", "mosaic_gpu")
_PLATFORM = {"mosaic": "tpu", "triton": "cuda", "mosaic_gpu": "cuda"}
CHIPS = ("tpu-v5e", "tpu-v6e", "gpu-a100", "gpu-h100", "gpu-h200", "gpu-b200")
# Compute capability of the GPU chips, for a deviceless compile that names its target.
_CAPABILITY = {"gpu-a100": (8, 0), "gpu-h100": (9, 0), "gpu-h200": (9, 0),
               "gpu-b200": (10, 0)}
_DEVICE_KINDS = (("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"), ("v6 lite", "tpu-v6e"),
                 ("v6e", "tpu-v6e"), ("a100", "gpu-a100"), ("h100", "gpu-h100"),
                 ("h200", "gpu-h200"), ("b200", "gpu-b200"))
_chip_override: list[str] = []
# The oldest JAX whose Mosaic GPU API the kernels use (checked in its interpreter).
MOSAIC_GPU_MIN_JAX = (0, 11, 2)
# Compute-capability majors of the tensor-core generations a Mosaic GPU body may serve.
HOPPER, BLACKWELL = 9, 10
_GENERATION_NAME = {8: "Ampere", HOPPER: "Hopper", BLACKWELL: "Blackwell"}


def generation_name(major: int) -> str:
  """A compute-capability major as people say it, for messages: "Hopper (9.x)"."""
  return f"{_GENERATION_NAME.get(major, 'compute capability')} ({major}.x)"


@contextlib.contextmanager
def target_chip(chip: str):
  """Tiles for `chip` (one of CHIPS) while tracing inside this context: for deviceless
  compiles, where jax.devices() are CPUs."""
  if chip not in CHIPS:
    raise ValueError(f"target_chip: `chip` must be one of {CHIPS}, got {chip!r}")
  _chip_override.append(chip)
  try:
    yield
  finally:
    _chip_override.pop()


def _target_device():
  """The device a program is traced for: an abstract mesh's device (an AOT or export
  target) where one is set, else the default device."""
  abstract = jax.sharding.get_abstract_mesh().abstract_device
  return abstract if abstract is not None else jax.devices()[0]


def current_chip() -> str | None:
  """The chip being compiled for: the override, else the target device's kind, else None."""
  if _chip_override:
    return _chip_override[-1]
  kind = _target_device().device_kind.lower()
  return next((chip for key, chip in _DEVICE_KINDS if key in kind), None)


def target_platform() -> str:
  """The platform a program is traced for: the abstract mesh's device's (an AOT or export
  target) where one is set, else JAX's default backend ("cpu", "gpu", "tpu")."""
  abstract = jax.sharding.get_abstract_mesh().abstract_device
  return abstract.platform if abstract is not None else jax.default_backend()


def compute_capability() -> tuple[int, int] | None:
  """(major, minor) of the CUDA GPU being compiled for, or None when it is not known (no
  GPU target, or an unknown abstract one)."""
  if (chip := current_chip()) in _CAPABILITY:
    return _CAPABILITY[chip]
  capability = getattr(_target_device(), "compute_capability", None)
  if isinstance(capability, str) and capability.replace(".", "").isdigit():
    return tuple(int(x) for x in capability.split("."))[:2]
  return None


def mosaic_gpu_available() -> bool:
  """Whether this JAX has the Mosaic GPU API the kernels are written for (`plgpu.kernel`, the
  GPU interpreter): 0.11.2 and newer (their interpreter tests pass on 0.11.2 and 0.12.0.1);
  0.10 has an older, incompatible one."""
  if jax.__version_info__ < MOSAIC_GPU_MIN_JAX:
    return False
  try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
  except ImportError:
    return False
  return hasattr(plgpu, "kernel") and hasattr(plgpu, "InterpretGPUParams")


def mosaic_gpu_module():
  """`jax.experimental.pallas.mosaic_gpu`, or a RuntimeError saying why not."""
  if not mosaic_gpu_available():
    raise RuntimeError(f"the Mosaic GPU kernels need jax >= 0.11.2 (plgpu.kernel and its "
                       f"interpreter); this is jax {jax.__version__}: use backend='triton'")
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu


def mosaic_gpu_dtype_ok(dtype) -> bool:
  """Whether the Mosaic GPU kernels run for inputs of `dtype` on a real chip: 16-bit only.
  On an H200 (jax 0.11.2) FlashFFN's float32 kernels fault (CUDA_ERROR_MISALIGNED_ADDRESS)
  although the interpreter runs them exactly; bfloat16 matched the reference there
  (the repository's benchmarks/README.md, GPU check)."""
  return jnp.dtype(dtype).itemsize == 2


# Where `backend=None` picks Mosaic GPU: per op (its `KernelConfig.op`), the generations on
# which its Mosaic GPU body was measured faster than Triton on a chip. A body measured on no
# chip is selectable (backend="mosaic_gpu") but not the default: FRAC's and Pack3D's Mosaic
# GPU bodies and FlashFFN's Blackwell (tcgen05) body have run only in the interpreter and the
# deviceless compile. Measured on an H200 (benchmarks/README.md, GPU check): FlashFFN bf16
# fwd+bwd 1.33x faster on Mosaic GPU than on Triton.
MEASURED_FASTER = {"mhffn": (HOPPER,), "mhffn_routed": (HOPPER,)}


def mosaic_gpu_serves(backends=BACKENDS, dtype=jnp.bfloat16, generations=(HOPPER,)) -> bool:
  """Whether an op with `backends` can run its Mosaic GPU body on the chip being compiled for
  with inputs of `dtype`: the body serves the chip's generation (`generations`: Hopper's
  WGMMA, and Blackwell's tcgen05 where the op lists it), this JAX has the API, and the inputs
  are 16-bit (`mosaic_gpu_dtype_ok`)."""
  capability = compute_capability()
  return ("mosaic_gpu" in backends and capability is not None
          and capability[0] in generations and mosaic_gpu_available()
          and mosaic_gpu_dtype_ok(dtype))


def gpu_backend(op: str, backends=BACKENDS, dtype=jnp.bfloat16,
                generations=(HOPPER,)) -> Backend:
  """The GPU kernel body `backend=None` runs for `op` on the chip being compiled for: Mosaic
  GPU where it serves the chip (`mosaic_gpu_serves`) and was measured faster than Triton on
  a chip of that generation (`MEASURED_FASTER`), else Triton."""
  capability = compute_capability()
  if (mosaic_gpu_serves(backends, dtype, generations)
      and capability[0] in MEASURED_FASTER.get(op, ())):
    return "mosaic_gpu"
  return "triton"


# The chip whose tuned entries an unknown GPU of a generation takes where that generation's
# kernels want other tiles than the generic entries (Blackwell's are 128 rows).
_GENERATION_CHIP = {BLACKWELL: "gpu-b200"}


def tuned(table: dict, backend: Backend, dtype, default):
  """The table entry for (backend, current chip, dtype name), else (backend, None, dtype),
  else `default`. Every 16-bit dtype looks up "bfloat16" (tiles are sized in bytes, and the
  Blackwell kernels need their chip's 128-row entries for float16 too). An unknown chip of a
  generation in `_GENERATION_CHIP` counts as that generation's chip."""
  name = "bfloat16" if jnp.dtype(dtype).itemsize == 2 else jnp.dtype(dtype).name
  chip = current_chip()
  if chip is None and (capability := compute_capability()) is not None:
    chip = _GENERATION_CHIP.get(capability[0])
  return table.get((backend, chip, name), table.get((backend, None, name), default))


def check_positive(op: str, blocks) -> None:
  """ValueError naming the first block-size field that is not a positive int."""
  checks.ints(op, dataclasses.asdict(blocks), what="block size ")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """How to run one op's kernels; hashable, so it can be a custom_vjp nondiff argument.

  op: the public name, for error messages.
  blocks_type: the op's frozen block-size dataclass, with `for_backend(backend, dtype)`
    giving the tuned entry for the current chip.
  backend: None picks per platform (and, on GPU, per chip: `gpu_backend`); "mosaic",
    "triton" or "mosaic_gpu" forces one kernel body.
  interpret: None interprets on CPU only; True (or the backend's interpreter params,
    `pltpu.InterpretParams` / `plgpu.InterpretGPUParams`) everywhere; False never.
  overrides: block-size fields set by the caller, as sorted (name, value) pairs.
  backends: the kernel bodies the op has.
  generations: the compute-capability majors its Mosaic GPU body serves (`gpu_backend`).
  """

  op: str
  blocks_type: type
  backend: Backend | None
  interpret: Any
  overrides: tuple
  backends: tuple = ("mosaic", "triton")
  generations: tuple = (HOPPER,)

  @classmethod
  def make(cls, op: str, blocks_type: type, *, backend, interpret, block_sizes: dict,
           backends: tuple = ("mosaic", "triton"), generations: tuple = (HOPPER,)):
    known = {f.name for f in dataclasses.fields(blocks_type)}
    unknown = set(block_sizes) - known
    if unknown:
      raise ValueError(f"{op}: unknown block size(s) {sorted(unknown)}; expected some of "
                       f"{sorted(known)}")
    if backend is not None and backend not in backends:
      raise ValueError(f"{op}: `backend` must be None or one of {backends}, got {backend!r}")
    if backend == "mosaic_gpu" and not mosaic_gpu_available():
      raise ValueError(f"{op}: backend='mosaic_gpu' needs jax >= 0.11.2 (plgpu.kernel and its "
                       f"interpreter); this is jax {jax.__version__}")
    cfg = cls(op, blocks_type, backend, interpret, tuple(sorted(block_sizes.items())),
              tuple(backends), tuple(generations))
    check_positive(op, dataclasses.replace(blocks_type(), **block_sizes))
    return cfg

  def blocks_for(self, backend: Backend, dtype):
    return dataclasses.replace(self.blocks_type.for_backend(backend, dtype),
                               **dict(self.overrides))


def _check_mosaic_gpu_compiles(cfg: KernelConfig, dtype) -> None:
  """A ValueError when a forced Mosaic GPU kernel is compiled for what it does not serve:
  float32 inputs, or a GPU generation its body has no tensor-core form for."""
  if not mosaic_gpu_dtype_ok(dtype):
    raise ValueError(f"{cfg.op}: backend='mosaic_gpu' compiles for 16-bit inputs only (its "
                     f"float32 kernels fault on a real GPU: measured on an H200), got "
                     f"{jnp.dtype(dtype).name}: use backend='triton' or None")
  capability = compute_capability()
  if capability is not None and capability[0] not in cfg.generations:
    served = ", ".join(generation_name(g) for g in cfg.generations)
    raise ValueError(f"{cfg.op}: backend='mosaic_gpu' has no kernel for "
                     f"{generation_name(capability[0])} GPUs (compute capability "
                     f"{capability[0]}.{capability[1]}; it serves {served}): use "
                     f"backend='triton' or None")


def traced_body(cfg: KernelConfig, dtype) -> tuple[Backend, bool]:
  """(backend, interpreted): the body `dispatch` runs in a program traced for
  `target_platform()`, for callers that lay out operands for it before the call (the branch
  `dispatch` leaves to lowering is the one this names, for a program lowered where it is traced)."""
  platform = target_platform()
  if cfg.interpret or (cfg.interpret is None and platform == "cpu"):
    return cfg.backend or "mosaic", True
  if cfg.backend:
    return cfg.backend, False
  return (gpu_backend(cfg.op, cfg.backends, dtype, cfg.generations) if platform == "gpu"
          else "mosaic"), False


def dispatch(fn, cfg: KernelConfig, *args):
  """Runs fn(backend, interpret, blocks, *args) with the lowering the platform calls for.

  The block sizes are looked up for the dtype of the first argument."""
  dtype = args[0].dtype
  if cfg.interpret:
    backend = cfg.backend or "mosaic"
    return fn(backend, cfg.interpret, cfg.blocks_for(backend, dtype), *args)

  def branch(backend: Backend, interpret: bool):
    return functools.partial(fn, backend, interpret, cfg.blocks_for(backend, dtype))

  if cfg.backend == "mosaic_gpu" and (cfg.interpret is False or target_platform() != "cpu"):
    _check_mosaic_gpu_compiles(cfg, dtype)
  if cfg.backend == "mosaic_gpu" and cfg.interpret is None:
    # The Mosaic GPU interpreter has ordered effects, and a platform_dependent branch
    # with effects breaks lowering for the other platforms (jax 0.12 lowers only the
    # platform's branch but expects the tokens of all). So the choice is made when the
    # program is traced: the interpreter when it is traced for CPU.
    return branch("mosaic_gpu", target_platform() == "cpu")(*args)

  # interpret=False on CPU: the compiled kernel, which Pallas refuses to lower there
  # (raising at trace time instead would also break TPU/GPU: every branch is traced).
  default = branch(cfg.backend or "mosaic", cfg.interpret is None)
  backends = (cfg.backend,) if cfg.backend else (
      "mosaic", gpu_backend(cfg.op, cfg.backends, dtype, cfg.generations))
  return jax.lax.platform_dependent(
      *args, default=default, **{_PLATFORM[b]: branch(b, False) for b in backends})
