"""A language model's whole sharded train step compiled for a TPU slice, without the chips.

The train step of `train.trainer.fit` (loss, gradients, AdamW with the decay mask, the
parameters' sharding rules of `models.partitioning`, the batch over data x fsdp) for a
`LanguageModel`, lowered for a deviceless TPU topology (`v5e:4x4`: 16 chips) and compiled
by libtpu. The model is a config's (`configs/lm_paper.py:<size>` by default), with its mixer,
FFN, context and remat overridable. Reports per chip what `memory_analysis()` says
(arguments: parameters, optimizer state and batch; outputs; temporaries), whether it fits the
chip's HBM with 10% headroom (exit status 1 if not), and the collectives in the optimized HLO
(kind: count). The step time comes from single-chip parts (`step_estimate.py`): libtpu's
static profile of a multi-chip program is not trusted (it gave one fusion's cycles for a whole
sharded step). Run in .venv-aot-tpu (`make scale-check` runs each paper size):

  PYTHONPATH=. .venv-aot-tpu/bin/python -m benchmarks.aot.scale \\
      --config=lm_paper:370m --mixer=frac --ffn=flashffn --context=32768
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time

from benchmarks.aot.targets import TARGETS, environment
from neurips26_jax import configs

HBM = {"v5e": 16 * 2**30, "v6e": 32 * 2**30}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")


def collectives(hlo: str) -> dict:
  """{kind: count} of the collective ops in an optimized HLO text (async starts counted once)."""
  counts = collections.Counter()
  for kind in COLLECTIVES:
    counts[kind] = len(re.findall(rf"= [^=]*? {kind}(?:-start)?\(", hlo))
  return {k: v for k, v in counts.items() if v}


def per_chip_gib(tree) -> float:
  """The bytes one chip holds of a tree of sharded ShapeDtypeStructs, in GiB."""
  import jax
  import numpy as np
  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
             for x in jax.tree.leaves(tree)) / 2**30


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--topology", default="v5e:4x4")
  parser.add_argument("--mesh", default="1,-1,1", help="data,fsdp,tensor (-1: the rest)")
  parser.add_argument("--config", default="lm_paper:125m",
                      help="a packaged config's name or a config file, with its argument after "
                           "':'; its `model` is compiled")
  parser.add_argument("--context", type=int, help="(default: the config's)")
  parser.add_argument("--mixer", help="(default: the config's)")
  parser.add_argument("--ffn", help="(default: the config's)")
  parser.add_argument("--remat", choices=("none", "full", "mixer"),
                      help="LanguageModel(remat=...) (default: the config's)")
  parser.add_argument("--batch_per_chip", type=int, default=1)
  parser.add_argument("--largest", type=int, default=0,
                      help="also list the N largest slices of the temporaries (their shapes)")
  parser.add_argument("--peak", type=int, default=0,
                      help="also list what is live at the peak: the N largest entries of the "
                           "compiler's stack-trace breakdown (jax op names)")
  parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                      help="a compiler option for an experiment (repeatable; true / false / "
                           "an int / text), e.g. xla_tpu_enable_latency_hiding_scheduler=false")
  args = parser.parse_args(argv)
  for key, value in environment(TARGETS["tpu-v5e"]).items():
    os.environ.setdefault(key, value)
  config = configs.load(args.config)
  model_kwargs = config.model.to_dict()
  model_kwargs.update({k: v for k, v in dict(context=args.context, mixer=args.mixer,
                                             ffn=args.ffn, remat=args.remat).items()
                       if v is not None})

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx
  from jax.experimental import topologies
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from neurips26_jax.models import LanguageModel
  from neurips26_jax.models.partitioning import BATCH_AXES, MESH_AXES
  from neurips26_jax.pallas_kernels.dispatch import target_chip
  from neurips26_jax.train import optim, sharding
  from neurips26_jax.train.lm_task import lm_loss

  topo = topologies.get_topology_desc(topology_name=args.topology, platform="tpu")
  chips = len(topo.devices)
  sizes = [int(s) for s in args.mesh.split(",")]
  sizes = [chips // -int(np.prod(sizes)) if s == -1 else s for s in sizes]
  mesh = Mesh(np.array(topo.devices).reshape(sizes), MESH_AXES)
  chip = "tpu-" + args.topology.split(":")[0]
  dtype = jnp.dtype(config.compute_dtype)

  def make_model():
    return LanguageModel(**dict(model_kwargs, impl="pallas"), interpret=False, dtype=dtype,
                         rngs=nnx.Rngs(0))

  # The abstract state is built outside the mesh context: logical axes are mapped to the
  # mesh here, and optax traces tx.init eagerly, which a deviceless mesh cannot run.
  with target_chip(chip):
    abstract = nnx.eval_shape(make_model)
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  param_count = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  as_spec = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  params = jax.tree.map(as_spec, params, sharding.state_shardings(params, mesh))
  rest = jax.tree.map(lambda x: as_spec(x, NamedSharding(mesh, P())), rest)
  tx = optax.chain(optax.clip_by_global_norm(1.0),        # as train.optim builds it
                   optax.adamw(1e-3, weight_decay=0.1, mask=optim.decay_mask))
  opt_state = jax.tree.map(as_spec, jax.eval_shape(tx.init, params),
                           sharding.optimizer_shardings(tx, params, mesh))
  with target_chip(chip), jax.set_mesh(mesh):
    batch = args.batch_per_chip * chips
    batch_sh = NamedSharding(mesh, P(BATCH_AXES))
    tokens = jax.ShapeDtypeStruct((batch, model_kwargs["context"]), jnp.int32, sharding=batch_sh)
    batch_spec = {"inputs": tokens, "targets": tokens}

    def train_step(state, batch):
      params, opt_state = state
      model_of = lambda p: nnx.merge(graphdef, p, rest)
      (loss, _), grads = jax.value_and_grad(lambda p: lm_loss(model_of(p), batch),
                                            has_aux=True)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    start = time.perf_counter()
    state = (params, opt_state)
    for name, tree in (("parameters", params), ("optimizer state", opt_state),
                       ("other model state", rest)):
      print(f"  {name}: {per_chip_gib(tree):.3f} GiB per chip")
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    dump = tempfile.mkdtemp(prefix="scale-") if args.largest or args.peak else None
    compiled = jax.jit(train_step, in_shardings=(state_sh, None), out_shardings=(state_sh, None),
                       donate_argnums=0).lower(state, batch_spec).compile(
                           compiler_options(args.option, dump))
  memory = compiled.memory_analysis()
  gib = lambda b: b / 2**30
  total = (memory.argument_size_in_bytes + memory.output_size_in_bytes
           + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
  limit = HBM[args.topology.split(":")[0]]
  fits = total <= 0.9 * limit
  m = model_kwargs
  print(f"{args.topology} mesh {dict(zip(MESH_AXES, sizes))}: {args.config} LanguageModel "
        f"d={m['d_model']} x{m['num_layers']} {m['mixer']}+{m['ffn']}, "
        f"{param_count / 1e6:.0f}M params, vocabulary {m['vocab_size']}, context {m['context']}, "
        f"batch {batch} ({args.batch_per_chip}/chip), {config.compute_dtype}"
        f", remat {m['remat']}; "
        f"compiled in "
        f"{time.perf_counter() - start:.0f} s")
  print(f"  per chip: arguments {gib(memory.argument_size_in_bytes):.2f} GiB, outputs "
        f"{gib(memory.output_size_in_bytes):.2f} (aliased {gib(memory.alias_size_in_bytes):.2f})"
        f", temporaries {gib(memory.temp_size_in_bytes):.2f}; total {gib(total):.2f} of "
        f"{gib(limit):.0f} GiB: {'fits' if fits else 'does NOT fit'} with 10% "
        f"headroom")
  hlo = compiled.as_text()
  kernel_calls = hlo.count('custom_call_target="tpu_custom_call"')
  print(f"  collectives: {collectives(hlo)}; Pallas kernel calls: {kernel_calls}")
  if args.largest:
    print(f"  the {args.largest} largest slices of the temporaries (MiB: values' shapes):")
    for line in largest_slices(dump, args.largest):
      print("    " + line)
  if args.peak:
    print(f"  live at the peak, the {args.peak} largest (MiB: jax op or argument):")
    for line in peak_breakdown(dump, args.peak):
      print("    " + line)
  if dump:
    shutil.rmtree(dump)
  return 0 if fits else 1


def compiler_options(pairs, dump: str | None) -> dict | None:
  """The compile's options: `--option` NAME=VALUE pairs, and the dump folder if any."""
  options = {"xla_dump_to": dump} if dump else {}
  for pair in pairs:
    name, _, value = pair.partition("=")
    flag = {"true": True, "false": False}.get(value.lower())
    options[name] = (flag if flag is not None
                     else int(value) if value.lstrip("-").isdigit() else value)
  return options or None


def _dump_text(dump: str, pattern: str) -> str:
  """The largest file of the compiler's dump matching `pattern`: the train step's module."""
  return max(pathlib.Path(dump).glob(pattern), key=lambda p: p.stat().st_size).read_text()


def largest_slices(dump: str, n: int) -> list:
  """The n largest slices of the largest allocation in the compiler's memory-usage report:
  "size MiB: the shapes of the values that share the slice" (offsets reused over time)."""
  report = _dump_text(dump, "*memory-usage-report.txt")
  tables = [t for t in report.split("cumulative_size;") if "shapes_list" in t]
  rows = []
  for line in tables[0].splitlines() if tables else []:
    cells = [c.strip() for c in line.split(";")]
    if len(cells) == 5 and cells[2].isdigit():
      size = cells[1]
      number, unit = re.match(r"([\d.]+)(\w+)", size).groups()
      scale = {"B": 2**-20, "KiB": 2**-10, "MiB": 1, "GiB": 2**10}[unit]
      rows.append((float(number) * scale, cells[4]))
  rows.sort(key=lambda r: -r[0])
  return [f"{mib:9,.1f}: {shapes[:150]}" for mib, shapes in rows[:n]]


def peak_breakdown(dump: str, n: int) -> list:
  """The n largest entries live at the peak, from the "Stack trace breakdown for peak usage" of
  the compiler's live-range dump: "MiB: the jax op (or argument) that made the value", leaves
  of the breakdown's tree (an entry's own bytes, `current`), summed over entries of one name."""
  text = _dump_text(dump, "*live-range.txt")
  section = text.partition("Stack trace breakdown for peak usage")[2]
  sizes = collections.Counter()
  for line in section.splitlines()[1:]:
    match = re.match(r"[\s│├└─]*(.+?) \([\d.]+%, total: [\d ]+ bytes, current: ([\d ]+) bytes",
                     line)
    current = int(match.group(2).replace(" ", "")) if match else 0
    if current:
      sizes[re.sub(r"\{\d+\}$", "", match.group(1))] += current
  return [f"{size / 2**20:9,.1f}: {name[:150]}" for name, size in sizes.most_common(n)]


if __name__ == "__main__":
  sys.exit(main())
