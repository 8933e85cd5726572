"""Parameters carry their logical axes and are created already sharded.

On the 8 simulated CPU devices (tests/conftest.py), mesh data x fsdp x tensor = 2 x 2 x 2:
every parameter is held once across each fsdp x tensor group (a quarter of the model per
device, replicated over data only), created under jax.jit in that layout, and training from
it gives the single-device losses.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from neurips26_jax.configs import lm_smoke
from neurips26_jax.models import LanguageModel, Pack3DSegmenter, UNet3D
from neurips26_jax.models import partitioning
from neurips26_jax.models.partitioning import logical_axes
from neurips26_jax.train import lm_task, optim, sharding, trainer
from neurips26_jax.train.metrics import read_metrics

MESH = {"data": 2, "fsdp": 2, "tensor": 2}


def lm_config(num_layers=2, **mesh):
  """FRAC mixer + FlashFFN (the heads-sharded layers), small enough for the shared CPU."""
  c = lm_smoke.get_config()
  c.steps, c.eval_every, c.eval_batches, c.checkpoint_every = 3, 3, 1, 3
  c.data.max_bytes = 100_000
  c.optim.warmup_steps = 1
  c.sample.num_tokens = 0
  c.model.update(d_model=32, num_layers=num_layers, num_heads=2, context=16, mixer="frac",
                 ffn="flashffn", impl="xla")
  c.model.mixer_options = {"head_dim": 16, "state_dim": 8}
  c.model.ffn_options = {"num_heads": 2, "num_experts": 2, "d_expert": 16}
  c.mesh.update(mesh or {"data": 1, "fsdp": 1, "tensor": 1})
  return c


def params_of(model):
  return jax.tree.leaves(nnx.state(model, nnx.Param))


def device_bytes(model, device) -> int:
  """Bytes of parameters `device` holds: the sum over its addressable shards."""
  return sum(s.data.nbytes for x in params_of(model) for s in x.addressable_shards
             if s.device == device)


@pytest.mark.parametrize("build", [
    lambda: LanguageModel(d_model=32, num_layers=1, num_heads=2, context=16, mixer="frac",
                          ffn="flashffn", mixer_options={"head_dim": 16, "state_dim": 8},
                          ffn_options={"num_heads": 2, "num_experts": 2, "d_expert": 16},
                          rngs=nnx.Rngs(0)),
    lambda: LanguageModel(d_model=32, num_layers=1, num_heads=2, context=16,
                          ffn_options={"d_ff": 64}, rngs=nnx.Rngs(0)),
    lambda: Pack3DSegmenter(patch=(2, 2, 2), in_channels=1, num_classes=3, d_model=48, depth=1,
                            num_heads=2, ffn="flashffn",
                            ffn_options={"num_heads": 2, "num_experts": 2, "d_expert": 16},
                          rngs=nnx.Rngs(0)),
    lambda: UNet3D(in_channels=1, num_classes=4, base_channels=8, levels=2, rngs=nnx.Rngs(0)),
], ids=["lm_frac_flashffn", "lm_attention_swiglu", "pack3d_segmenter", "unet3d"])
def test_every_parameter_carries_its_logical_axes(build):
  """The names live on the parameters (nnx.get_partition_spec reads them), one per dimension,
  and every array is sharded over at least one mesh axis on the 2x2x2 mesh."""
  model = nnx.eval_shape(build)
  state = nnx.state(model, nnx.Param)
  specs = jax.tree.leaves(nnx.get_partition_spec(state))
  variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert len(specs) == len(variables) > 0
  mesh = sharding.make_mesh(MESH)
  for path, v in nnx.to_flat_state(state):
    names = logical_axes(v)
    assert len(names) == v.ndim and any(names), (path, names)
    spec = sharding.spec_for(names, v.shape, mesh)
    assert any(spec), (path, names, v.shape)


def test_parameters_created_sharded_and_held_once_per_fsdp_tensor_group(capsys):
  """A device holds a quarter of the model (not all of it, as an eager one-device build would
  give): each parameter is split over the fsdp x tensor group (replicated over data only),
  except the per-head [H] vectors of FRAC (H = 2: split over tensor only)."""
  c = lm_config(**MESH)
  model = lm_task.make_model(c)
  mesh = sharding.make_mesh(c.mesh)
  total = sum(x.nbytes for x in params_of(model))
  per_device = [device_bytes(model, d) for d in mesh.devices.flat]
  with capsys.disabled():
    print(f"\nper-device parameter bytes (LM frac+flashffn d=32, 2 layers): {total} on every "
          f"device before -> {per_device[0]} on 2x2x2 ({total / per_device[0]:.2f}x less)")
  assert len(set(per_device)) == 1
  group = set(mesh.devices[0].flat)             # data index 0: one fsdp x tensor group
  twice = 0
  for x in params_of(model):
    assert x.sharding.mesh.shape == mesh.shape
    held = sum(s.data.size for s in x.addressable_shards if s.device in group)
    if held != x.size:                          # held more than once across the group
      assert x.ndim == 1 and x.shape[0] == c.model.num_heads, (x.shape, x.sharding.spec)
      twice += x.nbytes
  assert per_device[0] == (total + twice) / 4
  assert per_device[0] < 1.01 * total / 4


@pytest.mark.slow
def test_sharded_losses_equal_one_device(tmp_path):
  """3 training steps of a one-layer FRAC + FlashFFN LM (XLA path): 2x2x2 mesh vs one device.
  Slow (~45 s) and in the default run twice over: XLA's partitioner keeps the math (the
  attention LM's sharded run is tests/test_train.py's), and where layer code does the
  splitting (the kernels under shard_map) test_kernels_run_on_local_heads_under_shard_map
  checks outputs and gradients. rtol 1e-5
  (the same math with reductions split differently: float32 rounding only; seen: equal to 4
  decimals). The trained parameters stay in the init layout."""
  runs = {}
  for name, mesh in (("one", {}), ("mesh", MESH)):
    c = lm_config(num_layers=1, **mesh)
    result = trainer.fit(c, tmp_path / name, lm_task.build_task(c))
    runs[name] = [r["loss"] for r in read_metrics(pathlib.Path(tmp_path / name) / "metrics.jsonl")
                  if "loss" in r]
  print(f"\nlosses one device {runs['one']}, 2x2x2 {runs['mesh']}")
  assert len(runs["one"]) == 3
  np.testing.assert_allclose(runs["mesh"], runs["one"], rtol=1e-5)
  total = sum(x.nbytes for x in params_of(result.model))
  assert device_bytes(result.model, jax.devices()[0]) < 1.01 * total / 4


def _kernel_case(kind):
  """(model, inputs, [(module, kernel name)]) for a one-block model whose layers call their
  Pallas kernels (interpreted here) with H = 2 heads and a batch of 4: the FRAC mixer and
  FlashFFN in one LM block (one program for both), or Pack3D attention."""
  from neurips26_jax.pallas_kernels import flash_ffn, frac_scan, pack3d_attention
  tokens = jnp.arange(4 * 16).reshape(4, 16) % 256
  if kind == "frac_flashffn":
    model = LanguageModel(d_model=32, num_layers=1, num_heads=2, context=16, mixer="frac",
                          mixer_options={"head_dim": 16, "state_dim": 8, "chunk": 8},
                          ffn="flashffn",
                          ffn_options={"num_heads": 2, "num_experts": 2, "d_expert": 16},
                          impl="pallas", rngs=nnx.Rngs(0))
    return model, (tokens,), [(frac_scan, "frac_scan"), (flash_ffn, "mhffn_routed")]
  from tests.test_pack3d import packed
  coords, field_ids = packed(([(3, 4, 5)], [(2, 5, 6)], [(2, 3, 4), (3, 3, 4)], [(6, 5, 2)]))
  model = Pack3DSegmenter(patch=(1, 1, 1), in_channels=2, num_classes=3, d_model=12, depth=1,
                          num_heads=2, ffn_options={"d_ff": 16}, impl="pallas",
                          attention_options={"block_shape": (2, 2, 2), "max_cubes": 16},
                          rngs=nnx.Rngs(0))
  voxels = jax.random.normal(jax.random.key(1), coords.shape[:2] + (2,))
  return (model, (voxels, jnp.asarray(coords), jnp.asarray(field_ids)),
          [(pack3d_attention, "pack3d_attention")])


@pytest.mark.parametrize("kind", ["frac_flashffn", "pack3d"])
def test_kernels_run_on_local_heads_under_shard_map(kind, monkeypatch):
  """Under the 2x2x2 mesh each Pallas layer (FlashFFN, the FRAC mixer, Pack3D attention) runs
  its kernel on its local head (H = 2 split over tensor = 2) and a quarter of the batch, with
  its parameters entering split over "tensor" (no replication); outputs and parameter
  gradients equal the unsharded ones (to 1e-5 of each array's largest entry: float32
  reductions split differently). FRAC's gated norm spans all heads, so its
  statistic is summed across the split (partitioning.psum_heads), gradient included."""
  model, inputs, kernels = _kernel_case(kind)
  seen = {name: [] for _, name in kernels}
  for module, name in kernels:
    original = getattr(module, name)

    def spy(q, *args, _name=name, _original=original, **kwargs):
      seen[_name].append(q.shape)          # [B, L, H, head dim]
      return _original(q, *args, **kwargs)

    monkeypatch.setattr(module, name, spy)

  def loss(m, *inputs):
    return jnp.sum(jnp.sin(m(*inputs)))

  step = nnx.jit(lambda m, *inputs: nnx.value_and_grad(loss)(m, *inputs))
  expected = step(model, *inputs)
  shapes = {name: shapes[-1] for name, shapes in seen.items()}
  for batch, _, heads, _ in shapes.values():
    assert (batch, heads) == (4, 2)
  with jax.set_mesh(sharding.make_mesh(MESH)):
    got = step(model, *inputs)
  for name, (_, length, _, width) in shapes.items():   # B / (data fsdp), L, H / tensor, d_h
    assert seen[name][-1] == (1, length, 1, width), name
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.max(np.abs(b))))


def test_heads_the_tensor_axis_does_not_divide_run_replicated_on_a_sequence_split(monkeypatch):
  """FlashFFN with 3 heads under tensor = 2: its parameters enter whole and the tokens are split
  over tensor along L instead (shard_layer's fallback); outputs and gradients equal one
  device's."""
  from neurips26_jax.pallas_kernels import flash_ffn
  model = LanguageModel(d_model=48, num_layers=1, num_heads=3, context=16, ffn="flashffn",
                        ffn_options={"num_heads": 3, "num_experts": 2, "d_expert": 16},
                        impl="pallas",
                        rngs=nnx.Rngs(0))
  tokens = jnp.arange(4 * 16).reshape(4, 16) % 256
  seen, original = [], flash_ffn.mhffn_routed
  monkeypatch.setattr(flash_ffn, "mhffn_routed",
                      lambda q, *a, **k: seen.append(q.shape) or original(q, *a, **k))
  step = nnx.jit(lambda m: nnx.value_and_grad(lambda m: jnp.sum(jnp.sin(m(tokens))))(m))
  expected = step(model)
  with jax.set_mesh(sharding.make_mesh(MESH)):
    got = step(model)
  assert seen[-1] == (1, 8, 3, 16)               # B / (data fsdp), L / tensor, all 3 heads
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.max(np.abs(b))))


def test_optimizer_state_is_sharded_like_the_parameters():
  """AdamW's mu and nu live where their parameters do (each device a quarter on 2x2x2), not
  replicated on every device (what jit(tx.init) did)."""
  c = lm_config(**MESH)
  model = lm_task.make_model(c)
  mesh = sharding.make_mesh(c.mesh)
  tx = optim.make_optimizer(c.optim, c.steps)
  with jax.set_mesh(mesh):
    _, _, state = trainer._init_state(lm_task.build_task(c, model), tx, mesh)
  params = {jax.tree_util.keystr(k): x for k, x in jax.tree_util.tree_leaves_with_path(
      state["params"])}
  moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim >= 1]
  assert len(moments) >= 2 * len(params)
  by_shape = {(x.shape, x.sharding.spec) for x in params.values()}
  for x in moments:
    if x.ndim >= 2:
      assert (x.shape, x.sharding.spec) in by_shape, (x.shape, x.sharding.spec)
  held = sum(x.addressable_shards[0].data.nbytes for x in moments)
  assert held < 0.3 * sum(x.nbytes for x in moments)


def test_flashffn_casts_its_tables_before_the_op_only_where_they_are_split(monkeypatch):
  """FlashFFN hands its op the float32 tables as stored (the kernels cast them in VMEM: no
  copy), except where the mesh splits them (fsdp): gathered whole there anyway, they are cast
  to the compute dtype first, so the gather moves half the bytes."""
  from neurips26_jax.models import FlashFFN
  from neurips26_jax.models import flash_ffn as ffn_module
  seen = []
  original = ffn_module._ordered_layer

  def spy(x, w_in, router, k, u, v, *rest):
    seen.append({t.dtype for t in (k, u, v)})
    return original(x, w_in, router, k, u, v, *rest)

  monkeypatch.setattr(ffn_module, "_ordered_layer", spy)
  layer = FlashFFN(32, 2, 2, 16, impl="xla", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  x = jnp.ones((8, 4, 32), jnp.bfloat16)
  run = nnx.jit(lambda m, x: m(x))
  run(layer, x)
  with jax.set_mesh(sharding.make_mesh(MESH)):
    run(layer, x)
  assert seen == [{jnp.dtype(jnp.float32)}, {jnp.dtype(jnp.bfloat16)}]



def _equations(jaxpr, primitive: str) -> list:
  """Every equation of `primitive` in a jaxpr, its sub-jaxprs included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == primitive:
      found.append(eqn)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          found += _equations(inner, primitive)
  return found


def _all_gathers(jaxpr) -> list:
  """(dtype, input shape, axes) of every all_gather in a jaxpr, its sub-jaxprs included."""
  return [(e.invars[0].aval.dtype, e.invars[0].aval.shape, e.params["axis_name"])
          for e in _equations(jaxpr, "all_gather")]


def test_kernel_layers_gather_their_weights_inside_the_map_in_the_compute_dtype(monkeypatch):
  """Under the 2x2x2 mesh a FlashFFN on its kernel path (shard_layer) gets its parameters in
  their fsdp layout and gathers them inside the map: the tables and W_in / W_out (marked
  `cast`) in bf16, the router and norm gain (read in float32) as stored. The op then sees its
  local head's tables whole, in bf16. (A gather left to the partitioner at the map's boundary
  moves and holds them in float32, whole, for many layers at once: benchmarks/README.md.)"""
  from neurips26_jax.models import FlashFFN
  from neurips26_jax.pallas_kernels import flash_ffn
  seen = []
  original = flash_ffn.mhffn_routed
  monkeypatch.setattr(flash_ffn, "mhffn_routed", lambda q, router, k, *a, **kw: seen.append(
      (k.dtype, k.shape)) or original(q, router, k, *a, **kw))
  layer = FlashFFN(32, 2, 2, 16, impl="pallas", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  x = jnp.ones((4, 8, 32), jnp.bfloat16)
  loss = lambda m, x: jnp.sum(partitioning.shard_layer(m, x, split_heads=True)
                              .astype(jnp.float32) ** 2)
  with jax.set_mesh(sharding.make_mesh(MESH)):
    graphdef, state = nnx.split(layer)
    jaxpr = jax.make_jaxpr(lambda s, x: jax.grad(lambda s: loss(nnx.merge(graphdef, s), x))(s))(
        state, x)
  gathers = _all_gathers(jaxpr.jaxpr)
  assert seen and all(s == (jnp.dtype(jnp.bfloat16), (1, 2, 16, 16)) for s in seen), seen
  # tables [H / tensor, E, d_e / fsdp, d_h]; W_in [d / fsdp, H d_h / tensor], W_out transposed
  bf16 = sorted((shape, axes) for dtype, shape, axes in gathers if dtype == jnp.bfloat16)
  assert bf16 == sorted([((1, 2, 8, 16), ("fsdp",))] * 3 + [((16, 16), ("fsdp",))]
                        + [((16, 16), ("fsdp",))]), gathers
  f32 = sorted((shape, axes) for dtype, shape, axes in gathers if dtype == jnp.float32)
  assert f32 == [((1, 8), ("fsdp",)), ((1, 8, 2), ("fsdp",))], gathers


def test_flashffn_tables_split_over_their_head_width_when_fsdp_does_not_divide_d_e():
  """The tables [H, E, d_e, d_h] are split over fsdp along d_e, or along d_h where fsdp does
  not divide d_e (the 370M FRAC LM's d_e = 264 on 16 chips), never left whole on every chip
  (with their AdamW moments: 2.1 GiB per chip there, benchmarks/README.md)."""
  from neurips26_jax.models import FlashFFN
  mesh = jax.sharding.AbstractMesh((1, 16, 1), partitioning.MESH_AXES)
  for d_e, expected in ((256, P("tensor", None, "fsdp", None)),
                        (264, P("tensor", None, None, "fsdp"))):
    layer = nnx.eval_shape(lambda: FlashFFN(1024, 8, 9, d_e, rngs=nnx.Rngs(0)))
    for table in (layer.k, layer.u, layer.v):
      assert partitioning.spec_for(logical_axes(table), table.shape, mesh) == expected


def test_a_kernel_layers_gradients_are_reduced_before_the_layer_below_runs_its_backward():
  """Under the 2x2x2 mesh the backward of a shard_layer'd FlashFFN hands back x's cotangent
  and every parameter gradient behind one optimization barrier, so the layer below waits for
  this layer's reduced gradients; otherwise XLA combines every layer's gradient reduction
  into one collective at the end of the backward and holds all their whole gradients until
  then (125M on v5e-16: 1.17 -> 0.85 GiB per chip, benchmarks/README.md)."""
  from neurips26_jax.models import FlashFFN
  layer = FlashFFN(32, 2, 2, 16, impl="xla", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  x = jnp.ones((4, 8, 32), jnp.bfloat16)
  graphdef, state = nnx.split(layer)
  loss = lambda s, x: jnp.sum(partitioning.shard_layer(nnx.merge(graphdef, s), x,
                                                       split_heads=True).astype(jnp.float32))
  with jax.set_mesh(sharding.make_mesh(MESH)):
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(state, x)
  wanted = sorted([x.shape] + [p.shape for p in jax.tree.leaves(state)])
  barriers = [sorted(v.aval.shape for v in e.invars)
              for e in _equations(jaxpr.jaxpr, "optimization_barrier")]
  assert wanted in barriers, barriers


def test_remat_mixer_keeps_the_scan_through_the_layers_shard_map():
  """remat="mixer" under the 2x2x2 mesh: the FRAC scan's named outputs and chunk-start states,
  computed inside `shard_layer`'s shard_map, are still what the backward keeps (as the map's
  outputs): 2 more residuals per layer than "full", as on one device."""
  import contextlib
  import io

  from jax import ad_checkpoint

  def residuals(remat):
    model = LanguageModel(d_model=32, num_layers=2, num_heads=2, context=32, mixer="frac",
                          remat=remat, impl="pallas",
                          mixer_options={"head_dim": 16, "state_dim": 8}, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jnp.arange(4 * 32).reshape(4, 32) % 256
    printed = io.StringIO()
    with jax.set_mesh(sharding.make_mesh(MESH)), contextlib.redirect_stdout(printed):
      ad_checkpoint.print_saved_residuals(
          lambda s: jnp.mean(nnx.merge(graphdef, s)(tokens) ** 2), state)
    return printed.getvalue().splitlines()
  full = residuals("full")
  extra = [line for line in residuals("mixer") if line not in full]
  assert len(extra) == 4 and all("output of shard_map" in line for line in extra), extra
