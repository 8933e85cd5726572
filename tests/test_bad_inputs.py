"""Bad input to the public ops and layers: each case raises the expected exception type with a
message that names the argument. Concrete values raise at once; traced
values are checkify debug checks (last tests)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

from neurips26_jax.jaxops import flash_ffn, frac, pack3d, packing, rope
from neurips26_jax.jaxops.rms_norm import rms_normalize_groups
from neurips26_jax.models import (CausalAttention, FlashFFN, FRACMixer, LanguageModel,
                                  Pack3DAttention, Pack3DSegmenter, RMSNorm, SwiGLU, UNet3D)
from neurips26_jax.models.impl import kernel_body
from neurips26_jax.pallas_kernels import flash_ffn as ffn_kernel
from neurips26_jax.train import lm_task, seg3d_task


def ones(*shape, dtype=jnp.float32):
  return jnp.ones(shape, dtype)


def ffn_args(length=3, r=None, q_dtype=jnp.float32, experts=2):
  """mhffn inputs: q [1, L, 2, 8], r [1, L, 2, E] (uniform: normalized), k, u, v [2, E, 8, 8]."""
  r = ones(1, length, 2, experts) / experts if r is None else r
  return (ones(1, length, 2, 8, dtype=q_dtype), r, *(ones(2, experts, 8, 8),) * 3)


def scan_args(**replace):
  """frac_scan inputs x [1, 6, 2, 4], dt [1, 6, 2], b, c [1, 6, 2, 3], rates, weights [2, 3]."""
  args = dict(x=ones(1, 6, 2, 4), dt=ones(1, 6, 2), b=ones(1, 6, 2, 3), c=ones(1, 6, 2, 3),
              rates=ones(2, 3), weights=ones(2, 3))
  return {**args, **replace}


COORDS = packing.grid_coords((2, 2, 3))[None]           # one 2x2x3 field: [1, 12, 3]
FIELDS = np.zeros((1, 12), np.int32)


def p3d(n=12, coords=COORDS, field_ids=FIELDS, op=pack3d.pack3d_attention, **kwargs):
  q = ones(1, n, 2, 6)
  return op(q, q, q, coords, field_ids, **{"block_shape": (2, 2, 2), **kwargs})


rngs = lambda: nnx.Rngs(0)
ffn = functools.partial(FlashFFN, 32, 2, 2, 8, rngs=rngs())
mixer = functools.partial(FRACMixer, 16, num_heads=2, head_dim=8, state_dim=4, context=16)
attention = functools.partial(Pack3DAttention, 12, 2, block_shape=(2, 2, 2))
lm = functools.partial(LanguageModel, d_model=16, num_layers=1, num_heads=2, context=8,
                       ffn_options={"d_ff": 16})
segmenter = functools.partial(Pack3DSegmenter, patch=(2, 2, 2), num_classes=2, d_model=12,
                              depth=1, num_heads=2, ffn_options={"d_ff": 16})


def lm_batch(**bad):
  """Task.check_batch of the LM trainer on a batch with one field replaced."""
  ids = np.ones((2, 5), np.int32)
  batch = {"inputs": ids, "targets": ids, "mask": np.ones((2, 5), np.float32), **bad}
  lm_task.batch_checker(256)("training batch at step 3", batch)


def seg3d_batch(**bad):
  """Task.check_batch of the segmentation trainer on a packed batch with one field replaced."""
  batch = {"tokens": np.ones((1, 12, 8), np.float32), "labels": np.ones((1, 12, 8), np.int32),
           "coords": COORDS, "field_ids": FIELDS, "mask": np.ones((1, 12), np.float32)}
  seg3d_task.check_batch("evaluation batch 0", {**batch, **bad})


def attention_past_context():
  layer = CausalAttention(16, 2, context=4, rngs=rngs())
  cache = layer.init_cache(1)
  layer.step(ones(1, 16), {**cache, "pos": jnp.int32(4)})


# (id, call, exception, text the message must contain: the argument's name)
CASES = [
    # ---- FlashFFN op (jaxops, the Pallas entry point shares the checks)
    ("mhffn_empty_sequence", lambda: flash_ffn.mhffn(*ffn_args(length=0)), ValueError, "`q`"),
    ("mhffn_negative_router",
     lambda: flash_ffn.mhffn(*ffn_args(r=-ones(1, 3, 2, 2) / 2)), ValueError, "`r`"),
    ("mhffn_unnormalised_router",
     lambda: ffn_kernel.mhffn(*ffn_args(r=ones(1, 3, 2, 2))), ValueError, "`r`"),
    ("mhffn_nan_router", lambda: flash_ffn.mhffn_reference(
        *ffn_args(r=jnp.full((1, 3, 2, 2), jnp.nan))), ValueError, "`r`"),
    ("mhffn_int_q", lambda: flash_ffn.mhffn(*ffn_args(q_dtype=jnp.int32)), TypeError, "`q`"),
    ("mhffn_zero_experts", lambda: flash_ffn.mhffn(*ffn_args(experts=0)), ValueError, "`k`"),
    ("mhffn_chunk_zero", lambda: flash_ffn.mhffn(*ffn_args(), chunk=0), ValueError, "`chunk`"),
    ("mhffn_kernel_block_zero", lambda: ffn_kernel.mhffn(*ffn_args(), block_q=0), ValueError,
     "`block_q`"),
    ("swiglu_mismatched_down", lambda: flash_ffn.swiglu(ones(2, 4), ones(4, 6), ones(4, 6),
                                                        ones(5, 4)), ValueError, "`w_down`"),
    # ---- FRAC ops
    ("frac_scan_empty_sequence", lambda: frac.frac_scan(**scan_args(
        x=ones(1, 0, 2, 4), dt=ones(1, 0, 2), b=ones(1, 0, 2, 3), c=ones(1, 0, 2, 3))),
     ValueError, "`x`"),
    ("frac_scan_negative_dt", lambda: frac.frac_scan(**scan_args(dt=-ones(1, 6, 2))),
     ValueError, "`dt`"),
    ("frac_scan_nan_weights", lambda: frac.frac_scan_reference(**scan_args(
        weights=jnp.full((2, 3), jnp.nan))), ValueError, "`weights`"),
    ("frac_scan_inf_rates", lambda: frac.frac_scan(**scan_args(
        rates=jnp.full((2, 3), jnp.inf))), ValueError, "`rates`"),
    ("frac_scan_int_x", lambda: frac.frac_scan(**scan_args(x=ones(1, 6, 2, 4, dtype=jnp.int32))),
     TypeError, "`x`"),
    ("frac_scan_chunk_zero", lambda: frac.frac_scan(**scan_args(), chunk=0), ValueError,
     "`chunk`"),
    ("frac_step_wrong_rank", lambda: frac.frac_step(ones(1, 2, 3, 3, 4), ones(1, 4), ones(1, 2),
                                                    ones(1, 2, 3), ones(1, 2, 3), ones(2, 3),
                                                    ones(2, 3)), ValueError, "`x_t`"),
    ("soe_modes_negative_alpha", lambda: frac.soe_modes(-0.5, context=64), ValueError,
     "`alpha`"),
    ("soe_modes_two_modes", lambda: frac.soe_modes(0.5, num_modes=2, context=64), ValueError,
     "`num_modes`"),
    # ---- Pack3D op, RoPE, packing, norms
    ("pack3d_empty_sequence", lambda: p3d(n=0, coords=np.zeros((1, 0, 3), np.int32),
                                          field_ids=np.zeros((1, 0), np.int32)),
     ValueError, "`q`"),
    ("pack3d_block_shape_zero", lambda: p3d(block_shape=(0, 2, 2)), ValueError,
     "`block_shape[0]`"),
    ("pack3d_negative_radius", lambda: p3d(radius_blocks=-1), ValueError, "`radius_blocks`"),
    ("pack3d_coords_outside_field", lambda: p3d(coords=COORDS - 1), ValueError, "`coords`"),
    ("pack3d_float_field_ids", lambda: p3d(field_ids=FIELDS.astype(np.float32)), TypeError,
     "`field_ids`"),
    ("pack3d_field_id_out_of_range", lambda: p3d(field_ids=FIELDS + 1000), ValueError,
     "`field_ids`"),
    ("pack3d_max_cubes_zero", lambda: p3d(max_cubes=0), ValueError, "`max_cubes`"),
    ("rope_theta_zero", lambda: rope.axial_rope_3d(ones(1, 12, 2, 6), COORDS, theta=0.0),
     ValueError, "`theta`"),
    ("rope_int_x", lambda: rope.rope_1d(ones(1, 5, 2, 4, dtype=jnp.int32), jnp.zeros((1, 5))),
     TypeError, "`x`"),
    ("pack_fields_one_array", lambda: packing.pack_fields(np.ones((4, 4, 4, 2))), TypeError,
     "pass [grid]"),
    ("pack_fields_raw_volume", lambda: packing.pack_fields([np.ones((8, 8, 8, 3))], width=48),
     ValueError, "`width` is 48: a raw volume [Z, Y, X, C] is patchified (packing.patchify)"),
    ("patchify_patch_zero", lambda: packing.patchify(ones(4, 4, 4, 1), (4, 0, 4)), ValueError,
     "`patch[1]`"),
    ("rms_groups_not_dividing", lambda: rms_normalize_groups(ones(2, 10), 4), ValueError,
     "`groups`"),
    # ---- layers
    ("flashffn_zero_heads", lambda: FlashFFN(32, 0, 2, 8, rngs=rngs()), ValueError,
     "`num_heads`"),
    ("flashffn_d40_h4", lambda: FlashFFN(40, 4, 2, 8, rngs=rngs()), ValueError, "num_heads"),
    ("flashffn_d100_default_heads", lambda: FlashFFN(100, rngs=rngs()), ValueError,
     "`d_model` (100) has no default head count"),
    ("flashffn_negative_experts", lambda: FlashFFN(32, 2, -1, 8, rngs=rngs()), ValueError,
     "`num_experts`"),
    ("flashffn_d_expert_not_8x", lambda: FlashFFN(32, 2, 2, 12, rngs=rngs()), ValueError,
     "`d_expert`"),
    ("flashffn_unknown_backend", lambda: FlashFFN(32, 2, 2, 8, backend="cuda", rngs=rngs()),
     ValueError, "`backend`"),
    ("flashffn_backend_with_xla", lambda: FlashFFN(32, 2, 2, 8, impl="xla", backend="triton",
                                                   rngs=rngs()), ValueError, "`backend`"),
    ("pack3d_layer_backend_without_kernel",
     lambda: attention(merge="gated", backend="mosaic", rngs=rngs()), ValueError, "`backend`"),
    ("flashffn_unknown_impl", lambda: FlashFFN(32, 2, 2, 8, impl="cuda", rngs=rngs()),
     ValueError, "`impl`"),
    ("flashffn_empty_sequence", lambda: ffn()(ones(2, 0, 32)), ValueError, "`x`"),
    ("flashffn_wrong_width", lambda: ffn()(ones(2, 5, 30)), ValueError, "`x`"),
    ("flashffn_scalar_x", lambda: ffn()(ones()), ValueError, "`x`"),
    ("swiglu_zero_d_ff", lambda: SwiGLU(32, 0, rngs=rngs()), ValueError, "`d_ff`"),
    ("frac_heads_not_dividing_d", lambda: FRACMixer(64, num_heads=3, rngs=rngs()), ValueError,
     "`head_dim`"),
    ("frac_zero_state_dim", lambda: mixer(state_dim=0, rngs=rngs()), ValueError, "`state_dim`"),
    ("frac_two_modes", lambda: mixer(num_modes=2, rngs=rngs()), ValueError, "`num_modes`"),
    ("frac_int_x", lambda: mixer(rngs=rngs())(ones(1, 4, 16, dtype=jnp.int32)), TypeError,
     "`x`"),
    ("pack3d_layer_two_axis_blocks", lambda: attention(block_shape=(4, 4), rngs=rngs()),
     ValueError, "`block_shape`"),
    ("pack3d_layer_negative_heads", lambda: Pack3DAttention(12, -2, rngs=rngs()), ValueError,
     "`num_heads`"),
    ("pack3d_layer_coords_shape", lambda: attention(rngs=rngs())(
        ones(1, 12, 12), COORDS[..., :2], FIELDS), ValueError, "`coords`"),
    ("attention_zero_context", lambda: CausalAttention(16, 2, context=0, rngs=rngs()),
     ValueError, "`context`"),
    ("attention_step_past_context", attention_past_context, ValueError, "cache['pos']"),
    ("rmsnorm_zero_dim", lambda: RMSNorm(0), ValueError, "`dim`"),
    ("rmsnorm_wrong_width", lambda: RMSNorm(8)(ones(2, 6)), ValueError, "`x`"),
    ("lm_token_outside_vocab", lambda: lm(rngs=rngs())(jnp.array([[1, 256]])), ValueError,
     "`tokens`"),
    ("lm_negative_token", lambda: lm(rngs=rngs())(jnp.array([[-1, 2]])), ValueError,
     "`tokens`"),
    ("lm_float_tokens", lambda: lm(rngs=rngs())(ones(1, 4)), TypeError, "`tokens`"),
    ("lm_empty_sequence", lambda: lm(rngs=rngs())(jnp.zeros((1, 0), jnp.int32)), ValueError,
     "`tokens`"),
    ("lm_zero_vocab", lambda: lm(vocab_size=0, rngs=rngs()), ValueError, "`vocab_size`"),
    ("lm_mixer_option_misspelt",
     lambda: lm(mixer="frac", mixer_options={"head_dm": 8}, rngs=rngs()), ValueError,
     "LanguageModel: `mixer_options` has ['head_dm'], not an argument of FRACMixer; its "
     "arguments are ['alpha_init', 'alpha_min', 'backend', 'chunk', 'conv_width', 'head_dim',"),
    ("lm_mixer_option_the_model_sets",
     lambda: lm(mixer="attention", mixer_options={"context": 4}, rngs=rngs()), ValueError,
     "`mixer_options` sets ['context'], which LanguageModel sets itself"),
    ("lm_ffn_option_misspelt", lambda: lm(ffn_options={"dff": 16}, rngs=rngs()), ValueError,
     "`ffn_options` has ['dff'], not an argument of SwiGLU; its arguments are ['d_ff',"),
    ("segmenter_ffn_option_misspelt",
     lambda: segmenter(ffn="flashffn", ffn_options={"num_expert": 2}, rngs=rngs()), ValueError,
     "Pack3DSegmenter: `ffn_options` has ['num_expert'], not an argument of FlashFFN"),
    ("frac_step_cache_of_another_batch",
     lambda: mixer(rngs=rngs()).step(ones(3, 16), mixer(rngs=rngs()).init_cache(2)), ValueError,
     "`cache` has shapes {'conv_bc': (2, 3, 8), "),
    ("kernel_body_tpu_of_a_layer_built_for_xla",
     lambda: kernel_body(ffn(), ones(1, 4, 32), platform="tpu"), ValueError,
     "`platform`='tpu' asks what that chip runs, but FlashFFN was built with impl 'xla' "
     "(what impl='auto' is on this cpu machine), which runs no kernel on any chip: build it "
     "with impl='pallas'"),
    ("segmenter_patch_zero", lambda: segmenter(patch=(2, 2, 0), rngs=rngs()), ValueError,
     "`patch[2]`"),
    ("segmenter_token_width", lambda: segmenter(rngs=rngs())(ones(1, 12, 7), COORDS, FIELDS),
     ValueError, "`tokens`"),
    ("unet_zero_levels", lambda: UNet3D(num_classes=2, levels=0, rngs=rngs()), ValueError,
     "`levels`"),
    ("unet_wrong_channels", lambda: UNet3D(num_classes=2, base_channels=2, levels=1,
                                           rngs=rngs())(ones(1, 4, 4, 4, 3)),
     ValueError, "`image`"),
    # host-side checks of every training / evaluation batch (Task.check_batch)
    ("batch_target_outside_vocab",
     lambda: lm_batch(targets=np.array([[1, 2, 300, 4, 5]] * 2)), ValueError, "`targets`"),
    ("batch_negative_input", lambda: lm_batch(inputs=-np.ones((2, 5), np.int32)), ValueError,
     "`inputs`"),
    ("batch_float_ids", lambda: lm_batch(inputs=np.ones((2, 5), np.float32)), TypeError,
     "`inputs`"),
    ("batch_mask_above_one", lambda: lm_batch(mask=np.full((2, 5), 2.0)), ValueError, "`mask`"),
    ("batch_label_outside_classes",
     lambda: seg3d_batch(labels=np.full((1, 12, 8), 9, np.int32)), ValueError, "`labels`"),
    ("batch_nan_voxels", lambda: seg3d_batch(tokens=np.full((1, 12, 8), np.nan, np.float32)),
     ValueError, "`tokens`"),
    ("batch_negative_coords", lambda: seg3d_batch(coords=-COORDS), ValueError, "`coords`"),
    ("batch_field_id_too_large",
     lambda: seg3d_batch(field_ids=np.full((1, 12), 256, np.int32)), ValueError, "`field_ids`"),
]


@pytest.mark.parametrize("call, error, name", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_names_the_argument(call, error, name):
  with pytest.raises(error) as info:
    call()
  assert name in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_dtype_errors_are_also_value_errors():
  """Config-driven builders catch ValueError for any bad input; a dtype error is both."""
  with pytest.raises(ValueError):
    flash_ffn.mhffn(*ffn_args(q_dtype=jnp.int32))


@pytest.mark.parametrize("name", ["`dt`", "`r`", "`tokens`"],
                         ids=["frac_negative_dt", "mhffn_unnormalised_router",
                              "lm_token_outside_vocab"])
def test_traced_values_are_checkify_checks(name):
  """Under jit a value check cannot raise; it is a debug check, reported under checkify."""
  if name == "`tokens`":
    model = lm(rngs=rngs())
    call, bad = model, jnp.array([[1, 256]])
  elif name == "`dt`":
    call, bad = lambda dt: frac.frac_scan(**scan_args(dt=dt))[0], -ones(1, 6, 2)
  else:
    call, bad = lambda r: flash_ffn.mhffn(*ffn_args(r=r)), ones(1, 3, 2, 2)
  error, _ = checkify.checkify(jax.jit(call), errors=checkify.user_checks)(bad)
  assert name in (error.get() or ""), error.get()
