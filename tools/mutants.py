"""Mutation check: does the suite catch small, plausible bugs? (`make mutants`; not in `make test`)

Each mutant below is one deliberate bug: a file, an exact snippet of its current source (it
must occur exactly once), the replacement, and the tests expected to catch it. The runner
copies the working tree (git's tracked and untracked-but-not-ignored files) to a temporary
directory, applies one mutant at a time there, runs `pytest -x -q <tests>` in the copy and
restores the file; the working tree is never edited. A mutant is "killed" when the tests
fail, and the first failing test is reported. A survivor names a blind spot: add the test
that kills it, then list that test here.

  python -m tools.mutants                  # every mutant (about 15-30 min on 2 cores)
  python -m tools.mutants --check          # only check that every snippet still applies
  python -m tools.mutants frac_ rope_      # mutants whose name starts with one of these
  python -m tools.mutants --jobs 4         # mutants in parallel, one copy each
  python -m tools.mutants frac_ --tests tests/test_frac_model.py   # against other tests
  python -m tools.mutants --touching tests/test_pack3d.py          # mutants these tests kill

Before the mutants, the union of their tests runs once unmutated (skip with --no-baseline):
a failure there would make every mutant look killed. Exit status 1 if a mutant survives, a
snippet no longer applies, or the baseline fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

# Test files named by several mutants.
BLOCK = "tests/test_block.py"
FFN = "tests/test_flash_ffn.py"
FRAC = "tests/test_frac_model.py"
LM = "tests/test_lm.py"
P3L = "tests/test_pack3d_layer.py"
SEG = "tests/test_seg3d.py"
TS = "tests/test_trainer_semantics.py"
PS = "tests/test_param_sharding.py"
P3I = "tests/test_pack3d_independent.py"
KP = "tests/test_kernel_properties.py"
P3K = "tests/test_pack3d_levels_kernels.py"


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  path: str
  old: str
  new: str
  tests: tuple[str, ...]


def m(name, path, old, new, *tests):
  return Mutant(name, path, old, new, tuple(tests))


MUTANTS = [
    # ------------------------------------------------------------------ layer formulas
    m("pack3d_default_rotate_after", "models/pack3d.py",
      'rotate_summaries: str = "before"', 'rotate_summaries: str = "after"',
      f"{P3L}::test_pack3d_attention_formula_with_defaults"),
    m("pack3d_default_radius_2", "models/pack3d.py",
      "radius_blocks: int = 1, position", "radius_blocks: int = 2, position",
      f"{P3L}::test_pack3d_attention_formula_with_defaults"),
    m("pack3d_default_no_bias", "models/pack3d.py",
      "block_bias: bool = True", "block_bias: bool = False",
      f"{P3L}::test_pack3d_attention_formula_with_defaults"),
    m("pack3d_qk_swapped", "models/pack3d.py",
      "q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]",
      "k, q, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]",
      f"{P3L}::test_pack3d_attention_formula_with_defaults"),
    m("pack3d_k_not_rotated", "models/pack3d.py",
      "q, k = (rope.axial_rope_3d(t, coords, **self.rope) for t in (q, k))",
      "q = rope.axial_rope_3d(q, coords, **self.rope)",
      f"{P3L}::test_pack3d_attention_formula_with_defaults"),
    m("rope_frequencies_2k_over_m", "jaxops/rope.py",
      "freqs = theta ** (-jnp.arange(m, dtype=_F32) / m)",
      "freqs = theta ** (-2 * jnp.arange(m, dtype=_F32) / m)",
      f"{LM}::test_causal_attention_formula_and_init",
      f"{P3L}::test_pack3d_attention_formula_with_defaults"),
    m("rope_axial_axes_reversed", "jaxops/rope.py",
      "rope_angles(scaled[..., a], part, theta)", "rope_angles(scaled[..., 2 - a], part, theta)",
      "tests/test_rope.py", f"{P3L}::test_pack3d_attention_formula_with_defaults"),
    m("attention_scale_1_over_d", "models/attention.py",
      "logits * q.shape[-1] ** -0.5", "logits * q.shape[-1] ** -1.0",
      f"{LM}::test_causal_attention_formula_and_init"),
    m("attention_rope_theta_default", "models/attention.py",
      "rope_theta: float = 10000.0", "rope_theta: float = 500000.0",
      f"{LM}::test_causal_attention_formula_and_init"),
    m("frac_dt_exp_not_softplus", "models/frac.py",
      "dt = jax.nn.softplus(dt_raw.astype(_F32) + self.dt_bias[...].astype(_F32))",
      "dt = jnp.exp(dt_raw.astype(_F32) + self.dt_bias[...].astype(_F32))",
      f"{FRAC}::test_frac_mixer_formula_with_defaults"),
    m("frac_no_D_skip", "models/frac.py",
      "y = y.astype(_F32) + self.skip[...].astype(_F32)[:, None] * xs.astype(_F32)",
      "y = y.astype(_F32)",
      f"{FRAC}::test_frac_mixer_formula_with_defaults"),
    m("frac_norm_before_gate", "models/frac.py",
      "y = y.reshape(z.shape) * jax.nn.silu(z.astype(_F32))\n"
      "    y = (self._gated_norm(y) * self.norm_gain[...].astype(_F32)).astype(z.dtype)",
      "y = self._gated_norm(y.reshape(z.shape)) * jax.nn.silu(z.astype(_F32))\n"
      "    y = (y * self.norm_gain[...].astype(_F32)).astype(z.dtype)",
      f"{FRAC}::test_frac_mixer_formula_with_defaults"),
    m("frac_timescale_ignored", "models/frac.py",
      "return rates * jnp.exp(log_timescale)[:, None], weights", "return rates, weights",
      f"{FRAC}::test_frac_mixer_formula_with_defaults"),
    m("frac_alpha_plain_sigmoid", "models/frac.py",
      "return self.alpha_min + (1.0 - self.alpha_min) * jax.nn.sigmoid(logit)",
      "return jax.nn.sigmoid(logit)",
      f"{FRAC}::test_frac_mixer_init", f"{FRAC}::test_frac_mixer_formula_with_defaults"),
    m("frac_conv_not_causal", "models/frac.py",
      "causal = ((0, 0), (self.conv_weight.shape[0] - 1, 0), (0, 0))",
      "causal = ((0, 0), (0, self.conv_weight.shape[0] - 1), (0, 0))",
      "tests/test_frac_model.py", f"{FRAC}::test_frac_mixer_formula_with_defaults"),
    m("frac_default_modes_fixed", "models/frac.py",
      "(num_modes or frac_ops.default_num_modes(context))", "(num_modes or 16)",
      "tests/test_frac_model.py::test_cache_size_with_the_default_mode_count"),
    m("frac_fixed_dt_offset", "models/frac.py",
      "dt_raw = jnp.zeros(x.shape[:-1] + self.dt_bias.shape, dtype)",
      "dt_raw = jnp.ones(x.shape[:-1] + self.dt_bias.shape, dtype)",
      f"{FRAC}::test_frac_mixer_without_selective_dt"),
    m("frac_fixed_dt_still_selective", "models/frac.py",
      'self.dt_proj = param(dt_w, "embed", "heads", cast=True) if selective_dt else None',
      'self.dt_proj = param(dt_w, "embed", "heads", cast=True)',
      f"{FRAC}::test_frac_mixer_without_selective_dt"),
    m("flashffn_default_no_head_norm", "models/flash_ffn.py",
      "d_ff: int | None = None, head_norm: bool = True,",
      "d_ff: int | None = None, head_norm: bool = False,",
      f"{FFN}::test_flashffn_formula_with_defaults"),
    m("flashffn_router_softmax", "jaxops/flash_ffn.py",
      "sig = jax.nn.sigmoid(z.reshape(*lead, heads, experts))\n"
      "  r = sig / jnp.maximum(jnp.sum(sig, axis=-1, keepdims=True), 1e-20)",
      "r = jax.nn.softmax(z.reshape(*lead, heads, experts), axis=-1)",
      f"{FFN}::test_flashffn_formula_with_defaults"),
    m("flashffn_gain_not_folded_into_router", "jaxops/flash_ffn.py",
      "  return router if gain is None else router * gain[:, :, None].astype(router.dtype)",
      "  return router",
      f"{FFN}::test_flashffn_formula_with_defaults"),
    m("flashffn_gain_folded_into_v", "jaxops/flash_ffn.py",
      "return fold(k), fold(u), v.astype(dtype)", "return fold(k), fold(u), fold(v)",
      f"{FFN}::test_flashffn_formula_with_defaults"),
    m("swiglu_gelu", "jaxops/flash_ffn.py",
      "h = jax.nn.silu(x @ w_gate) * (x @ w_up)", "h = jax.nn.gelu(x @ w_gate) * (x @ w_up)",
      f"{FFN}::test_swiglu_formula_and_init"),
    m("rmsnorm_variance", "models/norm.py",
      "jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)",
      "jax.lax.rsqrt(jnp.var(x32, axis=-1, keepdims=True) + self.eps)",
      f"{BLOCK}::test_rmsnorm_formula_and_init"),
    m("block_ffn_uses_norm1", "models/block.py",
      "h = self.norm2(x)", "h = self.norm1(x)",
      f"{BLOCK}::test_block_is_pre_norm_residual"),
    m("block_step_ffn_without_norm", "models/block.py",
      "return x_t + self.ffn(self.norm2(x_t)[:, None])[:, 0], cache",
      "return x_t + self.ffn(x_t[:, None])[:, 0], cache",
      f"{BLOCK}::test_block_is_pre_norm_residual"),
    m("lm_no_final_norm", "models/lm.py",
      "x = block_call(self.remat, block, x)\n    return self.norm(x)",
      "x = block_call(self.remat, block, x)\n    return x",
      f"{LM}::test_language_model_formula_and_init"),
    m("lm_remat_mixer_saves_nothing", "models/lm.py",
      '"mixer": jax.checkpoint_policies.save_only_these_names(*MIXER_CORE),',
      '"mixer": jax.checkpoint_policies.nothing_saveable,',
      f"{LM}::test_remat_mixer_keeps_the_mixer_core_out_of_the_recomputation"),
    m("lm_remat_true_is_mixer", "models/lm.py",
      'remat = {False: "none", True: "full"}.get(remat, remat)',
      'remat = {False: "none", True: "mixer"}.get(remat, remat)',
      f"{LM}::test_remat_keeps_less_for_the_backward"),
    m("frac_scan_unnamed_for_remat", "jaxops/frac.py",
      "y, state, starts = checkpoint_name((y, state, starts), CHECKPOINT_NAME)", "pass",
      "tests/test_param_sharding.py::test_remat_mixer_keeps_the_scan_through_the_layers_shard_map",
      f"{LM}::test_remat_mixer_keeps_the_mixer_core_out_of_the_recomputation"),
    m("attention_heads_unnamed_for_remat", "models/attention.py",
      "checkpoint_name(causal_heads(q, k, v, chunk), CHECKPOINT_NAME)",
      "causal_heads(q, k, v, chunk)",
      f"{LM}::test_remat_mixer_keeps_the_mixer_core_out_of_the_recomputation"),
    m("attention_chunk_start_dropped", "models/attention.py",
      "(offset + jnp.arange(chunk))[:, None] >= keys", "jnp.arange(chunk)[:, None] >= keys",
      f"{LM}::test_query_chunks_attend_as_the_dense_form"),
    m("attention_chunks_kept_for_backward", "models/attention.py",
      "    @jax.checkpoint\n    def one_chunk(args,", "    def one_chunk(args,",
      f"{LM}::test_query_chunks_attend_as_the_dense_form"),
    m("lm_frac_default_context", "models/lm.py",
      "return FRACMixer(d_model, num_heads=num_heads, context=context, impl=impl,",
      "return FRACMixer(d_model, num_heads=num_heads, impl=impl,",
      f"{LM}::test_language_model_formula_and_init"),
    m("segmenter_no_embed_bias", "models/seg3d.py",
      " + self.embed_bias[...].astype(dtype)", "",
      f"{SEG}::test_pack3d_segmenter_formula_and_init"),
    m("unet_mean_pool", "models/unet3d.py",
      ".max(axis=(2, 4, 6))", ".mean(axis=(2, 4, 6))", f"{SEG}::test_unet3d_formula"),
    m("unet_skip_first", "models/unet3d.py",
      "jnp.concatenate([self.up[l](x), skips[l]], axis=-1)",
      "jnp.concatenate([skips[l], self.up[l](x)], axis=-1)", f"{SEG}::test_unet3d_formula"),
    m("unet_silu_before_norm", "models/unet3d.py",
      "x = jax.nn.silu(norm(conv(x)))", "x = norm(jax.nn.silu(conv(x)))",
      f"{SEG}::test_unet3d_formula"),
    # ------------------------------------------------------------------ initialisation
    m("flashffn_w_in_gain_1", "models/flash_ffn.py",
      "w_init = _xavier(0.707)", "w_init = _xavier(1.0)",
      f"{FFN}::test_flashffn_paper_init"),
    m("flashffn_tables_std_0.2", "models/flash_ffn.py",
      "gate_up = down = jax.nn.initializers.normal(0.02)",
      "gate_up = down = jax.nn.initializers.normal(0.2)",
      f"{FFN}::test_flashffn_paper_init"),
    m("flashffn_scaled_v_ignores_experts", "models/flash_ffn.py",
      "_normal(num_experts / d_expert)", "_normal(1 / d_expert)",
      f"{FFN}::test_flashffn_scaled_init"),
    m("flashffn_default_init_paper", "models/flash_ffn.py",
      'init: str = "scaled"', 'init: str = "paper"',
      "tests/test_flash_ffn.py::test_default_init_starts_at_swiglu_scale"),
    m("flashffn_default_head_width_32", "models/flash_ffn.py",
      "DEFAULT_HEAD_DIM = 128", "DEFAULT_HEAD_DIM = 32",
      "tests/test_flash_ffn.py::test_default_shape_matches_the_swiglu_default"),
    m("flashffn_shape_one_expert", "models/flash_ffn.py",
      "experts = max(2, round(", "experts = max(1, round(",
      "tests/test_flash_ffn.py::test_default_shape_matches_the_swiglu_default"),
    m("swiglu_default_width_4d", "models/flash_ffn.py",
      "return 8 * math.ceil(8 * d_model / 3 / 8)", "return 4 * d_model",
      "tests/test_flash_ffn.py::test_default_shape_matches_the_swiglu_default"),
    m("lm_ffn_ignores_the_mixer_size", "models/lm.py",
      "params=block_params - param_count(mixer_layer)", "params=block_params",
      "tests/test_lm.py::test_builds_without_options_at_the_default_parameter_count"),
    m("scale_marked_decayed", "models/partitioning.py",
      'variable.set_metadata("weight_decay", False)', 'variable.set_metadata("weight_decay", True)',
      f"{TS}::test_scales_are_never_decayed_whatever_their_rank"),
    m("decay_mask_by_rank_only", "train/optim.py",
      'x.ndim >= 2 and x.get_metadata("weight_decay", True)', "x.ndim >= 2",
      f"{TS}::test_scales_are_never_decayed_whatever_their_rank"),
    m("flashffn_router_untruncated", "models/flash_ffn.py",
      "jax.nn.initializers.truncated_normal(0.02)(", "jax.nn.initializers.normal(0.02)(",
      f"{FFN}::test_flashffn_scaled_init",
      f"{FFN}::test_flashffn_paper_init"),
    m("frac_D_init_zero", "models/frac.py",
      "self.skip = param(jnp.ones((num_heads,), param_dtype)",
      "self.skip = param(jnp.zeros((num_heads,), param_dtype)",
      f"{FRAC}::test_frac_mixer_init"),
    m("frac_dt_init_mamba_range", "models/frac.py",
      "math.log(0.5),\n                                    math.log(2.0)",
      "math.log(0.001),\n                                    math.log(0.1)",
      f"{FRAC}::test_frac_mixer_init"),
    m("frac_alpha_spread_to_0.8", "models/frac.py",
      "frac = np.linspace(ALPHA_INIT_SPAN, 1 - ALPHA_INIT_SPAN, num_heads)",
      "frac = np.linspace(ALPHA_INIT_SPAN, 1 - 2 * ALPHA_INIT_SPAN, num_heads)",
      f"{FRAC}::test_frac_mixer_init"),
    m("frac_alpha_min_0.2", "models/frac.py", "ALPHA_MIN = 0.05", "ALPHA_MIN = 0.2",
      f"{FRAC}::test_frac_mixer_init"),
    m("frac_lowest_head_on_the_clip", "models/frac.py",
      "ALPHA_INIT_SPAN = 0.15", "ALPHA_INIT_SPAN = 0.001",
      f"{FRAC}::test_frac_mixer_init"),
    m("frac_mamba_ssm_a_range", "models/frac.py",
      "MAMBA_SSM_A_RANGE = (1.0, 16.0)", "MAMBA_SSM_A_RANGE = (1.0, 8.0)",
      f"{FRAC}::test_mamba_ssm_init"),
    m("frac_mamba_ssm_a_not_log", "models/frac.py",
      "log_a = jnp.log(jax.random.uniform(a_key,", "log_a = (jax.random.uniform(a_key,",
      f"{FRAC}::test_mamba_ssm_init"),
    m("frac_mamba_ssm_dt_range", "models/frac.py",
      "MAMBA_SSM_DT_RANGE = (1e-3, 1e-1)", "MAMBA_SSM_DT_RANGE = (1e-2, 1.0)",
      f"{FRAC}::test_mamba_ssm_init"),
    m("lm_head_init_1_over_d", "models/lm.py",
      "(d_model, vocab_size)) * d_model ** -0.5,", "(d_model, vocab_size)) * d_model ** -1.0,",
      f"{LM}::test_language_model_formula_and_init"),
    # ------------------------------------------------------------------ trainer semantics
    m("schedule_decay_steps_after_warmup", "train/optim.py",
      "decay_steps=max(steps, c.warmup_steps + 1)",
      "decay_steps=max(steps - c.warmup_steps, 1)",
      f"{TS}::test_schedule_values"),
    m("schedule_end_value", "train/optim.py",
      "end_value=c.lr * c.min_lr_ratio", "end_value=c.min_lr_ratio",
      f"{TS}::test_schedule_values"),
    m("schedule_warmup_from_lr_over_10", "train/optim.py",
      "init_value=0.0", "init_value=0.1 * c.lr", f"{TS}::test_schedule_values"),
    m("clip_after_adamw", "train/optim.py",
      "      optax.clip_by_global_norm(c.clip_norm),\n"
      "      optax.adamw(schedule(c, steps), b1=c.b1, b2=c.b2, weight_decay=c.weight_decay,\n"
      "                  mask=decay_mask))",
      "      optax.adamw(schedule(c, steps), b1=c.b1, b2=c.b2, weight_decay=c.weight_decay,\n"
      "                  mask=decay_mask),\n"
      "      optax.clip_by_global_norm(c.clip_norm))",
      f"{TS}::test_huge_gradient_updates_like_its_clipped_version"),
    m("adamw_b2_default", "train/optim.py",
      "b1=c.b1, b2=c.b2", "b1=c.b1, b2=0.999",
      f"{TS}::test_optimizer_is_clip_then_adamw_as_configured"),
    m("weight_decay_on_gains", "train/optim.py",
      "    return x.ndim >= 2\n  return", "    return x.ndim >= 1\n  return",
      f"{TS}::test_optimizer_is_clip_then_adamw_as_configured"),
    m("train_batch_off_by_one", "train/trainer.py",
      'sharding.put_batch(_batch(task, "train", step),',
      'sharding.put_batch(_batch(task, "train", step + 1),',
      f"{TS}::test_training_follows_the_numpy_trajectory"),
    m("logged_lr_of_next_step", "train/trainer.py",
      '"lr": lr(state["step"])', '"lr": lr(state["step"] + 1)',
      f"{TS}::test_training_follows_the_numpy_trajectory"),
    m("grad_norm_of_updates", "train/trainer.py",
      '"grad_norm": optax.tree.norm(grads)', '"grad_norm": optax.tree.norm(updates)',
      f"{TS}::test_training_follows_the_numpy_trajectory"),
    m("eval_on_train_batches", "train/trainer.py",
      'eval_fn(params, sharding.put_batch(_batch(task, "eval", i), mesh))',
      'eval_fn(params, sharding.put_batch(_batch(task, "train", i), mesh))',
      f"{TS}::test_evaluation_reads_the_evaluation_batches"),
    m("eval_one_batch_only", "train/trainer.py",
      "for i in range(config.eval_batches)]", "for i in range(1)]",
      f"{TS}::test_evaluation_reads_the_evaluation_batches"),
    m("text_eval_windows_from_train_split", "train/lm_task.py",
      "functools.partial(batch, val_bytes, text.VAL)",
      "functools.partial(batch, train_bytes, text.VAL)",
      f"{TS}::test_text_evaluation_windows_come_from_the_validation_split"),
    m("text_split_train_keeps_val", "train/data/text.py",
      "return corpus[:cut], corpus[cut:]", "return corpus, corpus[cut:]",
      f"{TS}::test_text_evaluation_windows_come_from_the_validation_split"),
    m("masked_loss_ignores_mask", "train/losses.py",
      "return (ce * mask).sum() / count, (correct * mask).sum() / count",
      "return ce.mean(), (correct * mask).sum() / count",
      f"{TS}::test_lm_loss_is_the_masked_mean_cross_entropy"),
    m("chunked_loss_counts_padding", "jaxops/tiling.py",
      "  x = jnp.pad(x, ((0, 0), (0, steps * chunk - length)) + ((0, 0),) * (x.ndim - 2))",
      "  x = jnp.pad(x, ((0, 0), (0, steps * chunk - length)) + ((0, 0),) * (x.ndim - 2),\n"
      "              constant_values=1)",
      f"{TS}::test_chunked_cross_entropy_is_the_whole_logits_loss"),
    m("chunked_loss_keeps_every_chunk", "train/losses.py",
      "  @jax.checkpoint\n  def step(sums, xs):", "  def step(sums, xs):",
      f"{TS}::test_chunked_cross_entropy_is_the_whole_logits_loss"),
    m("lm_loss_whole_logits", "train/lm_task.py",
      "  loss, accuracy = chunked_cross_entropy(model.features(batch[\"inputs\"]), model.logits,\n"
      "                                         batch[\"targets\"], mask)",
      "  loss, accuracy = chunked_cross_entropy(model.features(batch[\"inputs\"]), model.logits,\n"
      "                                         batch[\"targets\"], mask, chunk=2**30)",
      "tests/test_lm.py::test_lm_loss_chunks_a_large_vocabulary"),
    m("dice_counts_background", "train/seg3d_task.py",
      "for c in range(1, logits.shape[-1]):", "for c in range(logits.shape[-1]):",
      f"{TS}::test_segmentation_loss_and_macro_dice"),
    # ------------------------------------------------------------------ sharding
    m("param_axes_dropped", "models/partitioning.py",
      "variable = nnx.Param(value, **axes_metadata(*names))",
      "variable = nnx.Param(value)",
      "tests/test_param_sharding.py::test_every_parameter_carries_its_logical_axes"),
    m("fsdp_rule_dropped", "models/partitioning.py",
      '"embed": ("fsdp",),', '"embed": (),',
      "tests/test_param_sharding.py::"
      "test_parameters_created_sharded_and_held_once_per_fsdp_tensor_group"),
    m("kernel_heads_not_split", "models/partitioning.py",
      'keep[i] = "tensor"', "keep[i] = None",
      "tests/test_param_sharding.py::test_kernels_run_on_local_heads_under_shard_map"),
    m("kernel_params_enter_replicated", "models/partitioning.py",
      "enter = list(spec_for(names, variable.shape, mesh))", "enter = [None] * len(names)",
      f"{PS}::test_kernel_layers_gather_their_weights_inside_the_map_in_the_compute_dtype"),
    m("kernel_params_cast_after_gather", "models/partitioning.py",
      """_gather(v[...].astype(dtype) if v.get_metadata("cast", False)
                               else v[...], *layout)""",
      """_gather(v[...], *layout).astype(dtype if v.get_metadata("cast", False)
                                                  else v[...].dtype)""",
      f"{PS}::test_kernel_layers_gather_their_weights_inside_the_map_in_the_compute_dtype"),
    m("kernel_gradients_reduced_unordered", "models/partitioning.py",
      "  return jax.lax.optimization_barrier(vjp(dy))", "  return vjp(dy)",
      f"{PS}::test_a_kernel_layers_gradients_are_reduced_before_the_layer_below_runs_its_backward"),
    m("flashffn_table_not_cast", "models/flash_ffn.py",
      "self.k = param(gate_up(rngs.params(), shape, param_dtype), *table_axes, cast=True)",
      "self.k = param(gate_up(rngs.params(), shape, param_dtype), *table_axes)",
      f"{PS}::test_kernel_layers_gather_their_weights_inside_the_map_in_the_compute_dtype"),
    m("flashffn_tables_without_fallback_axis", "models/flash_ffn.py",
      'table_axes = ("heads", None, "expert_mlp", "head_dim")',
      'table_axes = ("heads", None, "expert_mlp", None)',
      f"{PS}::test_flashffn_tables_split_over_their_head_width_when_fsdp_does_not_divide_d_e"),
    m("frac_norm_local_heads_only", "models/partitioning.py",
      'return jax.lax.psum(x, "tensor")', "return x",
      "tests/test_param_sharding.py::test_kernels_run_on_local_heads_under_shard_map"),
    # ------------------------------------------------------------------ shared op math
    m("rms_normalize_backward_without_projection", "jaxops/rms_norm.py",
      "dx = rstd * (dy32 - y32 * jnp.mean(dy32 * y32, axis=-1, keepdims=True))",
      "dx = rstd * dy32",
      "tests/test_flash_ffn.py::test_rms_normalize_gradient_matches_autodiff"),
    m("pack3d_reference_radius_plus_1", "jaxops/pack3d.py",
      "local = same_field & (distance <= radius_blocks)",
      "local = same_field & (distance <= radius_blocks + 1)",
      "tests/test_pack3d.py::test_xla_options_match_reference"),
    m("pack3d_summary_vbar_not_mean", "jaxops/pack3d.py",
      "vbar = jnp.sum(v_cubes.astype(_F32), axis=2) * inv_n",
      "vbar = jnp.sum(v_cubes.astype(_F32), axis=2)",
      "tests/test_pack3d.py::test_xla_options_match_reference"),
    m("frac_modes_one_fewer", "jaxops/frac.py",
      "return math.ceil(math.log(S_HIGH * context / S_LOW)) + 2",
      "return math.ceil(math.log(S_HIGH * context / S_LOW)) + 1",
      "tests/test_frac_modes.py", "tests/test_frac_model.py"),
    m("frac_tail_rate", "jaxops/frac.py",
      "tail_rate = b * alpha / (alpha + 1)", "tail_rate = b * alpha",
      f"{FRAC}::test_frac_mixer_init", "tests/test_frac_modes.py"),
    # ------------------------------------------------------------------ kernel tile math
    m("flashffn_kernel_dkuv_reduction_parallel", "pallas_kernels/flash_ffn/mosaic.py",
      '_params(plan, "parallel", "parallel", "arbitrary"),\n      # dq overwrites ds',
      '_params(plan, "parallel", "parallel", "parallel"),\n      # dq overwrites ds',
      f"{KP}::test_no_races_and_no_uninitialized_reads[flash_ffn]"),
    m("flashffn_routed_padding_lanes_in_router_sum", "pallas_kernels/flash_ffn/mosaic.py",
      "sig = jnp.where(lanes < router.experts, jax.nn.sigmoid(dot(q, w_r)), 0.0)",
      "sig = jax.nn.sigmoid(dot(q, w_r))",
      "tests/test_flash_ffn_routed.py::test_matches_reference_forward_and_gradients"),
    m("flashffn_routed_norm_backward_without_mean", "pallas_kernels/flash_ffn/mosaic.py",
      "return rstd * (dq_hat - y * jnp.mean(dq_hat * y, axis=1, keepdims=True)), dz",
      "return rstd * dq_hat, dz",
      "tests/test_flash_ffn_routed.py::test_matches_reference_forward_and_gradients"),
    m("flashffn_routed_dw_r_not_reset_per_head", "pallas_kernels/flash_ffn/mosaic.py",
      "    for acc in accs:\n      acc[...] = jnp.zeros_like(acc)",
      "    for acc in accs[:3]:\n      acc[...] = jnp.zeros_like(acc)",
      "tests/test_flash_ffn_routed.py::test_matches_reference_forward_and_gradients"),
    m("flashffn_routed_gain_not_folded_into_router", "pallas_kernels/flash_ffn/__init__.py",
      "    w_r = fold_router_gain(w_r, gain)", "    w_r = w_r",
      "tests/test_flash_ffn_routed.py::test_matches_reference_forward_and_gradients"),
    m("flashffn_routed_gain_not_staged_into_k", "pallas_kernels/flash_ffn/mosaic.py",
      "  for src, dst, folded in zip(raw, staged, (True, True, False)):",
      "  for src, dst, folded in zip(raw, staged, (False, True, False)):",
      "tests/test_flash_ffn_routed.py::test_matches_reference_forward_and_gradients"),
    m("flashffn_routed_table_grads_without_gain", "pallas_kernels/flash_ffn/mosaic.py",
      "      grad = [x * g for x in grad]", "      grad = list(grad)",
      "tests/test_flash_ffn_routed.py::test_matches_reference_forward_and_gradients"),
    m("flashffn_routed_dgain_against_folded_tables", "pallas_kernels/flash_ffn/mosaic.py",
      "      grad = [x * g for x in grad]\n",
      "      grad = [x * g for x in grad]\n      dgain = dgain * g\n",
      "tests/test_flash_ffn_routed.py::test_matches_reference_forward_and_gradients"),
    m("flashffn_routed_tables_staged_in_parallel", "pallas_kernels/flash_ffn/mosaic.py",
      '"arbitrary" if router else "parallel",', '"parallel",',
      f"{KP}::test_no_races_and_no_uninitialized_reads[flash_ffn-routed]"),
    m("flashffn_mosaic_group_partials_not_summed", "pallas_kernels/flash_ffn/mosaic.py",
      "dq = jnp.sum(dq, axis=0).astype(q.dtype)", "dq = dq[0].astype(q.dtype)",
      f"{FFN}::test_mosaic_loop_forms"),
    m("flashffn_mosaic_tile_loop_offset_dropped", "pallas_kernels/flash_ffn/mosaic.py",
      "lambda c, carry: body(pl.ds(pl.multiple_of(c * bi, bi), bi), carry)",
      "lambda c, carry: body(pl.ds(0, bi), carry)",
      f"{FFN}::test_mosaic_loop_forms"),
    m("flashffn_mosaic_transposed_grads_untransposed", "pallas_kernels/flash_ffn/mosaic.py",
      "grads = [[acc[e].T if transposed else acc[e] for e in range(plan.experts_per_step)]",
      "grads = [[acc[e] if transposed else acc[e].T for e in range(plan.experts_per_step)]",
      f"{FFN}::test_mosaic_loop_forms"),
    m("frac_tpu_chunk_ignored", "pallas_kernels/frac_scan/__init__.py",
      "    return make(TPU_CHUNK.get(current_chip(), TPU_CHUNK[None]))", "    return make(32)",
      "tests/test_frac_scan.py::test_default_chunk_per_chip"),
    m("frac_stacked_padded_modes_not_masked", "jaxops/frac_chunk.py",
      "jnp.where(_iota((k_rows, 1), 0) < num_modes * n, 1.0, 0.0)",
      "jnp.where(_iota((k_rows, 1), 0) >= 0, 1.0, 0.0)",
      "tests/test_frac_scan.py::test_stacked_chunk_equals_mode_at_a_time"),
    m("frac_stacked_keep_dropped_from_dstate", "jaxops/frac_chunk.py",
      "dstate_start = keep_col * dstate + ", "dstate_start = dstate + ",
      "tests/test_frac_scan.py::test_stacked_chunk_equals_mode_at_a_time", "tests/test_frac_scan.py::test_matches_reference_forward_and_gradients[mosaic-f32]"),
    m("frac_stacked_keep_decay_dropped_from_rates", "jaxops/frac_chunk.py",
      "(k.t_end - t)) + g_keep * k.t_end)", "(k.t_end - t)))",
      "tests/test_frac_scan.py::test_stacked_chunk_equals_mode_at_a_time", "tests/test_frac_scan.py::test_matches_reference_forward_and_gradients[mosaic-f32]"),
    m("frac_stacked_float32_rounded_to_bf16", "jaxops/frac_chunk.py",
      "_split_dot(form, a, b, 3 if low == _F32 else 2)", "_split_dot(form, a, b, 1)",
      "tests/test_frac_scan.py::test_matches_reference_forward_and_gradients[mosaic-f32]"),
    m("frac_stacked_update_decay_sign", "jaxops/frac_chunk.py",
      "jnp.exp(-st.rate_col * (k.t_end - k.t_row))", "jnp.exp(-st.rate_col * (k.t_row - k.t_end))",
      "tests/test_frac_scan.py::test_matches_reference_forward_and_gradients[mosaic-f32]"),
    m("frac_stacked_state_products_one_bf16_pass", "jaxops/frac_chunk.py",
      "for j, q in enumerate(_bf16_parts(b, 2)) if i + j < 2)",
      "for j, q in enumerate(_bf16_parts(b, 2)) if i + j < 1)",
      "tests/test_frac_scan.py::test_stacked_chunk_equals_mode_at_a_time[bf16]"),
    m("frac_stacked_float32_state_products_16_bits", "jaxops/frac_chunk.py",
      "  if low == _F32:\n    return _f32(form, a, b)\n  return sum(",
      "  if low is None:\n    return _f32(form, a, b)\n  return sum(",
      "tests/test_frac_scan.py::test_stacked_chunk_equals_mode_at_a_time[f32]",
      "tests/test_frac_scan.py::test_matches_reference_forward_and_gradients[mosaic-f32]"),
    m("frac_running_sum_vjp_same_triangle", "jaxops/frac_chunk.py",
      "lambda _, g: (_by_triangle(g.astype(_F32), lower=True),)",
      "lambda _, g: (_by_triangle(g.astype(_F32), lower=False),)",
      "tests/test_frac_scan.py::test_running_sum_is_cumsum"),
    m("frac_running_sum_rounded_to_bf16", "jaxops/frac_chunk.py",
      "preferred_element_type=_F32), a, triangle, 3)",
      "preferred_element_type=_F32), a, triangle, 1)",
      "tests/test_frac_scan.py::test_running_sum_is_cumsum"),
    m("frac_stacked_dt_sign", "jaxops/frac_chunk.py",
      "dt_col = _rowsum((g_out - g_in) * rates)", "dt_col = _rowsum((g_out + g_in) * rates)",
      "tests/test_frac_scan.py::test_matches_reference_forward_and_gradients[mosaic-f32]"),
    m("frac_stacked_rep_off_by_one", "jaxops/frac_chunk.py",
      "one(same_n(_iota((k_rows, n), 0), _iota((k_rows, n), 1)))",
      "one(same_n(_iota((k_rows, n), 0) + 1, _iota((k_rows, n), 1)))",
      "tests/test_frac_scan.py::test_matches_reference_forward_and_gradients[mosaic-f32]"),
    m("frac_mosaic_whole_length_block_read_from_zero", "pallas_kernels/frac_scan/mosaic.py",
      "self.first_col = (lambda i: step_index(i) * tokens) if whole else (lambda i: 0)",
      "self.first_col = lambda i: 0",
      "tests/test_frac_scan.py::test_mosaic_several_chunks_per_grid_step"),
    m("frac_mosaic_transposed_block_stays_at_step_0", "pallas_kernels/frac_scan/mosaic.py",
      "lambda g, i: (g, 0, 0 if whole else step_index(i)))",
      "lambda g, i: (g, 0, 0))",
      "tests/test_frac_scan.py::test_mosaic_several_chunks_per_grid_step"),
    m("frac_mosaic_backward_step_walks_forward", "pallas_kernels/frac_scan/mosaic.py",
      "    u = per_step - 1 - v ", "    u = v ",
      "tests/test_frac_scan.py::test_mosaic_several_chunks_per_grid_step"),
    m("frac_mosaic_starts_saved_once_per_step", "pallas_kernels/frac_scan/mosaic.py",
      "      starts_ref[0, u] = state[...]", "      starts_ref[0, 0] = state[...]", "tests/test_frac_scan.py::test_mosaic_several_chunks_per_grid_step"),
    m("frac_kernel_chunk_axis_parallel", "pallas_kernels/frac_scan/mosaic.py",
      'dimension_semantics=("parallel", "arbitrary")',
      'dimension_semantics=("parallel", "parallel")',
      f"{KP}::test_no_races_and_no_uninitialized_reads[frac_scan]"),
    m("frac_mosaic_gpu_time_padded_with_zeros", "pallas_kernels/frac_scan/mosaic_gpu.py",
      '_pad_tokens(grid, t[..., 0], mode="edge")', "_pad_tokens(grid, t[..., 0])",
      "tests/test_frac_mosaic_gpu.py::test_matches_independent_reference"),
    m("frac_mosaic_gpu_keep_decay_dropped_from_t_end", "pallas_kernels/frac_scan/mosaic_gpu.py",
      "reshape(k.groups, grid.length) + dt_keep", "reshape(k.groups, grid.length)",
      "tests/test_frac_mosaic_gpu.py::test_matches_independent_reference"),
    m("frac_mosaic_gpu_keep_decay_dropped_from_rates", "pallas_kernels/frac_scan/mosaic_gpu.py",
      "Modes((dmodes[:, 1] + drates_keep)[:, None]", "Modes(dmodes[:, 1, None]",
      "tests/test_frac_mosaic_gpu.py::test_matches_independent_reference"),
    m("frac_mosaic_gpu_walk_drops_the_initial_state", "pallas_kernels/frac_scan/mosaic_gpu.py",
      "b = own.at[:, 0].add(a[:, 0] * initial)", "b = own",
      "tests/test_frac_mosaic_gpu.py::test_matches_independent_reference"),
    m("frac_mosaic_gpu_walk_back_drops_the_final_cotangent",
      "pallas_kernels/frac_scan/mosaic_gpu.py",
      "b = own.at[:, -1].add(a[:, -1] * dfinal)", "b = own",
      "tests/test_frac_mosaic_gpu.py::test_matches_independent_reference"),
    m("frac_mosaic_gpu_any_mode_count_served", "pallas_kernels/frac_scan/mosaic_gpu.py",
      "if plan.m_pad * plan.n > MAX_MODES_X_N:", "if False:",
      "tests/test_frac_mosaic_gpu.py::test_forced_mosaic_gpu_names_what_it_cannot_serve"),
    m("frac_mosaic_gpu_state_terms_get_start_cotangents", "pallas_kernels/frac_scan/mosaic_gpu.py",
      "jnp.concatenate([dstarts[:, 1:], dfinal[:, None]], axis=1)", "dstarts",
      "tests/test_frac_mosaic_gpu.py::test_matches_independent_reference"),
    m("frac_mosaic_gpu_chunk_end_cotangent_at_its_start", "pallas_kernels/frac_scan/mosaic_gpu.py",
      "dt_kernel.at[:, :, -1].add(ends)", "dt_kernel.at[:, :, 0].add(ends)",
      "tests/test_frac_mosaic_gpu.py::test_matches_independent_reference"),
    m("flashffn_kernel_silu_derivative", "pallas_kernels/flash_ffn/tiles.py",
      "g * n * sig * (1.0 + m * (1.0 - sig))", "g * n * sig * (1.0 + m * sig)",
      "tests/test_flash_ffn.py::test_matches_reference_forward_and_gradients"),
    m("flashffn_kernel_router_weight_dropped", "pallas_kernels/flash_ffn/tiles.py",
      "return m * sigmoid(m) * n * r_e", "return m * sigmoid(m) * n",
      "tests/test_flash_ffn.py::test_matches_reference_forward_and_gradients"),
    m("pack3d_triton_dkv_row_block_offset_dropped", "pallas_kernels/pack3d_attention/triton.py",
      "* parts + jax.lax.rem(j, parts), r)", "* parts, r)",
      "tests/test_pack3d.py::test_matches_reference_forward_and_gradients"),
    m("pack3d_mosaic_heads_share_lanes", "pallas_kernels/pack3d_attention/mosaic.py",
      "return slice(h * plan.d, (h + 1) * plan.d)", "return slice(0, plan.d)",
      "tests/test_pack3d.py::test_matches_reference_forward_and_gradients[mosaic-f32]"),
    m("pack3d_mosaic_statistics_of_head_0", "pallas_kernels/pack3d_attention/mosaic.py",
      "return jnp.expand_dims(rows_ref[0, 0, h], -1)", "return jnp.expand_dims(rows_ref[0, 0, 0], -1)",
      "tests/test_pack3d.py::test_matches_reference_forward_and_gradients[mosaic-f32]"),
    m("pack3d_mosaic_lse_rows_shifted", "pallas_kernels/pack3d_attention/mosaic.py",
      "== jax.lax.broadcasted_iota(jnp.int32, (t, t), 1))",
      "== jax.lax.broadcasted_iota(jnp.int32, (t, t), 1) + 1)",
      "tests/test_pack3d.py::test_matches_reference_forward_and_gradients[mosaic-f32]"),
    m("pack3d_mosaic_lane_groups_stacked_reversed", "pallas_kernels/pack3d_attention/mosaic.py",
      "for j in range(plan.groups)], 0)", "for j in reversed(range(plan.groups))], 0)",
      "tests/test_pack3d.py::test_mosaic_slot_rows_of_several_slots_match_reference"),
    m("marker_reach_level1_cubes", "experiments/repacking.py",
      'cube2 = (batch["coords"] // np.asarray(block_shape)) >> 1',
      'cube2 = batch["coords"] // np.asarray(block_shape)',
      "tests/test_experiments.py::test_marker_reach_is_level2_cube_distance_to_the_marker"),
    m("report_pairs_widths_across_pythons", "experiments/report.py",
      'against=("flashffn_h128",) if one_corpus else ()', 'against=("flashffn_h128",)',
      "tests/test_experiments.py::test_lm_ffn_report_pairs_widths_and_marks_partial_sweeps"),
    m("throughput_state_not_carried", "experiments/common.py",
      "      times[arm].append((time.perf_counter() - t) / per_round)\n      state[arm] = (params, opt_state)",
      "      times[arm].append((time.perf_counter() - t) / per_round)",
      "tests/test_experiments.py::test_throughput_interleaves_arms_and_keeps_each_best_round"),
    m("pack3d_lane_groups_for_every_body", "pallas_kernels/pack3d_attention/__init__.py",
      'if backend == "mosaic" else 1', "if backend else 1",
      "tests/test_pack3d.py::test_only_the_mosaic_body_gets_grouped_rows"),
    m("dispatch_traced_body_ignores_gpu", "pallas_kernels/dispatch.py",
      'if platform == "gpu"\n          else "mosaic"), False',
      'if platform == "cuda"\n          else "mosaic"), False',
      "tests/test_pack3d.py::test_only_the_mosaic_body_gets_grouped_rows"),
    m("pack3d_slot_groups_row_major", "jaxops/pack3d_layout.py",
      "return jnp.swapaxes(x, 2, 3).reshape(b, rows // groups, groups * f)",
      "return x.reshape(b, rows // groups, groups * f)",
      "tests/test_pack3d.py::test_grouped_slot_rows_place_slot_j_t_over_g_plus_i_in_row_i"),
    m("pack3d_slot_position_ungrouped", "jaxops/pack3d_layout.py",
      "position = cube * t + i * groups + j", "position = cube * t + j * (t // groups) + i",
      "tests/test_pack3d.py::test_mosaic_slot_rows_of_several_slots_match_reference"),
    m("pack3d_triton_padding_lanes_kept", "pallas_kernels/pack3d_attention/triton.py",
      "x = jnp.swapaxes(x[..., :plan.head_dim], 1, 2)", "x = jnp.swapaxes(x[..., -plan.head_dim:], 1, 2)",
      "tests/test_pack3d.py::test_matches_reference_forward_and_gradients[triton-f32]"),
    m("pack3d_mosaic_gpu_padding_columns_kept", "pallas_kernels/pack3d_attention/mosaic_gpu.py",
      "return x[..., :plan.head_dim].reshape", "return x[..., -plan.head_dim:].reshape",
      "tests/test_pack3d_mosaic_gpu.py::test_forward_and_grads_far_offset_f32"),
    m("pack3d_mosaic_gpu_transposed_lse_on_rows", "pallas_kernels/pack3d_attention/mosaic_gpu.py",
      "- _bcast(lse_c, shape, 1))", "- _bcast(lse_c, shape, 0))",
      "tests/test_pack3d_mosaic_gpu.py::test_forward_and_grads_far_offset_f32"),
    m("pack3d_mosaic_gpu_d_far_offset_dropped", "pallas_kernels/pack3d_attention/mosaic_gpu.py",
      "tuple(c + jnp.sum(ds, axis=1) for c in carry[2:])",
      "tuple(c + 0.0 * jnp.sum(ds, axis=1) for c in carry[2:])",
      "tests/test_pack3d_mosaic_gpu.py::test_forward_and_grads_far_offset_f32"),
    # ------------------------------------------------------------------ Pack3D multi-level
    m("pack3d_levels_candidates_beyond_the_parent_radius", "jaxops/pack3d_levels.py",
      "np.arange(-radius_up, radius_up + 1)", "np.arange(-radius_up - 1, radius_up + 2)",
      "tests/test_pack3d_levels.py::test_xla_path_matches_the_independent_reference"),
    m("pack3d_levels_plain_mean_of_children", "jaxops/pack3d_levels.py",
      "jax.ops.segment_sum(count[:, None, None] * s, slot, slots) * inv",
      "jax.ops.segment_sum(s, slot, slots) / jnp.maximum("
      "jax.ops.segment_sum(jnp.ones_like(count), slot, slots), 1.0)[:, None, None]",
      "tests/test_pack3d_levels.py::test_xla_path_matches_the_independent_reference"),
    m("pack3d_levels_first_level_offset_everywhere", "jaxops/pack3d.py",
      "offsets.append(jnp.repeat(beta[k - 1][:, None]",
      "offsets.append(jnp.repeat(beta[0][:, None]",
      "tests/test_pack3d_levels.py"),
    m("pack3d_layer_levels_not_passed", "models/pack3d.py",
      "self.op_kwargs.update(levels=levels, level_radius=level_radius, max_top_cubes=", "dict(max_top_cubes=",
      "tests/test_pack3d_levels.py::test_layer_with_levels_is_its_formula"),
    m("pack3d_levels_top_radius_inclusive", "jaxops/pack3d_levels.py",
      "& (cube_distance(own, keys[None, :, 1:]) > radius))",
      "& (cube_distance(own, keys[None, :, 1:]) >= radius))",
      "tests/test_pack3d_levels.py::test_xla_path_matches_the_independent_reference"),
    m("pack3d_levels_top_overflow_not_poisoned", "jaxops/pack3d.py",
      "levels_lib.poison_top_overflow(o, layout.keys, layout.count, levels, top)", "(o)",
      "tests/test_pack3d_levels.py::test_max_top_cubes_bounds_the_top_level_and_poisons_an_overflow"),
    m("pack3d_levels_top_bound_ignored", "jaxops/pack3d_levels.py",
      "return min(bound or keys.shape[1], keys.shape[1])", "return keys.shape[1]",
      "tests/test_pack3d_levels.py::test_max_top_cubes_bounds_the_top_level_and_poisons_an_overflow"),
    m("pack3d_levels_key_gain_one_level_up", "jaxops/pack3d_levels.py",
      "kbar_k * key_gain ** (k - 1), vbar_k", "kbar_k * key_gain ** k, vbar_k",
      "tests/test_pack3d_levels.py::test_xla_path_matches_the_independent_reference"),
    m("pack3d_levels_default_key_gain_one", "jaxops/pack3d_levels.py",
      "KEY_GAIN = 8.0", "KEY_GAIN = 1.0",
      "tests/test_pack3d_levels.py::test_xla_path_matches_the_independent_reference"),
    m("pack3d_levels_options_miss_the_key_gain", "jaxops/pack3d_levels.py",
      '"max_top_cubes", "level_key_gain")', '"max_top_cubes")',
      "tests/test_experiments.py::test_every_joint_arm_has_a_local_twin_with_its_parameters"),
    m("pack3d_levels_key_gain_bool_accepted", "jaxops/pack3d_levels.py",
      "isinstance(level_key_gain, bool) or not", "not",
      "tests/test_pack3d_levels.py::test_bad_level_options_are_one_line_errors"),
    m("pack3d_levels_key_gain_not_bounded", "jaxops/pack3d_levels.py",
      "< float(np.finfo(np.float32).max)):", "):",
      "tests/test_pack3d_levels.py::test_bad_level_options_are_one_line_errors"),
    m("pack3d_levels_key_gain_on_the_values", "jaxops/pack3d_levels.py",
      "kbar_k * key_gain ** (k - 1), vbar_k", "kbar_k, vbar_k * key_gain ** (k - 1)",
      "tests/test_pack3d_levels.py::test_xla_path_matches_the_independent_reference"),
    m("pack3d_layer_key_gain_not_passed", "models/pack3d.py",
      "                            level_key_gain=level_key_gain)", "                            )",
      "tests/test_pack3d_levels.py::test_layer_with_levels_is_its_formula"),
    m("pack3d_kernel_key_gain_dropped", "pallas_kernels/pack3d_attention/__init__.py",
      "levels_lib.level_structure(*a, levels, key_gain)", "levels_lib.level_structure(*a, levels, 1.0)",
      f"{P3K}::test_kernel_matches_the_independent_reference"),
    m("pack3d_levels_radius_rule_off", "jaxops/pack3d_levels.py",
      "if k < levels and radii[k] < math.ceil(r / 2):", "if False:",
      "tests/test_pack3d_levels.py::test_bad_level_options_are_one_line_errors"),
    # the kernels' far test with levels (pallas_kernels/pack3d_attention/tiles.py)
    m("pack3d_kernel_levels_parent_radius_exclusive", "pallas_kernels/pack3d_attention/tiles.py",
      "far = far & (b >= 2.0 * (parent - up))", "far = far & (b > 2.0 * (parent - up))",
      f"{P3K}::test_kernel_matches_the_independent_reference"),
    m("pack3d_kernel_levels_own_radius_inclusive", "pallas_kernels/pack3d_attention/tiles.py",
      "far = jnp.maximum(jnp.maximum(gaps[0], gaps[1]), gaps[2]) > radius",
      "far = jnp.maximum(jnp.maximum(gaps[0], gaps[1]), gaps[2]) >= radius",
      f"{P3K}::test_kernel_matches_the_independent_reference"),
    m("pack3d_kernel_levels_level_row_ignored", "pallas_kernels/pack3d_attention/tiles.py",
      "hit = (level == k) & far", "hit = far",
      f"{P3K}::test_kernel_matches_the_independent_reference"),
    m("pack3d_kernel_levels_query_cube_not_coarsened", "pallas_kernels/pack3d_attention/tiles.py",
      "mine = [_ancestor(c, k - 1) for c in own]", "mine = list(own)",
      f"{P3K}::test_kernel_matches_the_independent_reference"),
    m("pack3d_kernel_levels_level_1_untagged", "pallas_kernels/pack3d_attention/__init__.py",
      "[tagged(rows, 1)]", "[rows]",
      f"{P3K}::test_kernel_matches_the_independent_reference"),
    m("pack3d_kernel_levels_offset_of_the_wrong_level", "pallas_kernels/pack3d_attention/tiles.py",
      "jnp.where(rows[5] == k, beta, 0.0)", "jnp.where(rows[5] == 1, beta, 0.0)",
      f"{P3K}::test_kernel_matches_the_independent_reference"),
    m("pack3d_kernel_levels_d_offset_level_shifted", "pallas_kernels/pack3d_attention/__init__.py",
      "jnp.arange(1, plan.offset_levels + 1, dtype=_F32)",
      "jnp.arange(0, plan.offset_levels, dtype=_F32)",
      f"{P3K}::test_kernel_matches_the_independent_reference"),
    m("pack3d_kernel_levels_top_overflow_not_poisoned", "pallas_kernels/pack3d_attention/__init__.py",
      "o = levels_lib.poison_top_overflow(o, layout.keys, layout.count, levels, top_slots)", "pass",
      f"{P3K}::test_traced_coordinates_with_max_top_cubes"),
    # ------------------------------------------------------------------ GPU dispatch
    m("mosaic_gpu_float32_allowed", "pallas_kernels/dispatch.py",
      "return jnp.dtype(dtype).itemsize == 2", "return True",
      "tests/test_flash_ffn.py::test_auto_picks_the_gpu_kernel_per_chip",
      "tests/test_flash_ffn.py::test_forced_mosaic_gpu_refuses_float32_on_a_gpu"),
    m("mosaic_gpu_not_picked_on_hopper", "pallas_kernels/dispatch.py",
      "and capability[0] in generations", "and capability[0] - 1 in generations",
      "tests/test_flash_ffn.py::test_auto_picks_the_gpu_kernel_per_chip"),
    m("mosaic_gpu_forced_generation_unchecked", "pallas_kernels/dispatch.py",
      "if capability is not None and capability[0] not in cfg.generations:",
      "if False:",
      "tests/test_frac_mosaic_gpu.py::test_forced_mosaic_gpu_refused_where_it_has_no_kernel"),
    m("unknown_blackwell_takes_generic_tiles", "pallas_kernels/dispatch.py",
      "chip = _GENERATION_CHIP.get(capability[0])", "chip = None",
      "tests/test_flash_ffn_blackwell.py::test_unknown_blackwell_chip_gets_the_b200_tiles"),
    m("flash_ffn_blackwell_wide_heads_kept", "pallas_kernels/flash_ffn/tiles.py",
      "return tuple(g for g, limit in MAX_D_H.items() if width <= limit)",
      "return tuple(MAX_D_H)",
      "tests/test_flash_ffn_blackwell.py::test_auto_takes_triton_on_blackwell_for_wide_heads"),
    m("flash_ffn_hopper_max_d_h_raised", "pallas_kernels/flash_ffn/tiles.py",
      "MAX_D_H = {HOPPER: 256, BLACKWELL: 128}", "MAX_D_H = {HOPPER: 512, BLACKWELL: 128}",
      "tests/test_flash_ffn_blackwell.py::test_auto_takes_triton_on_hopper_beyond_its_widest_head"),
    m("mosaic_gpu_not_picked_on_blackwell", "pallas_kernels/flash_ffn/__init__.py",
      "else mosaic_gpu_generations(q.shape[-1], q.dtype))",
      "else mosaic_gpu_generations(q.shape[-1], q.dtype)[:1])",
      "tests/test_flash_ffn_blackwell.py::test_auto_picks_mosaic_gpu_on_blackwell_once_measured"),
    m("flash_ffn_forced_generation_dropped_for_width", "pallas_kernels/flash_ffn/__init__.py",
      "generations = (tuple(MAX_D_H) if backend",
      "generations = (mosaic_gpu_generations(q.shape[-1], q.dtype) if backend",
      "tests/test_flash_ffn_blackwell.py::test_forced_mosaic_gpu_on_blackwell_names_the_limit"),
    m("float16_takes_generic_tiles", "pallas_kernels/dispatch.py",
      'name = "bfloat16" if jnp.dtype(dtype).itemsize == 2 else jnp.dtype(dtype).name',
      "name = jnp.dtype(dtype).name",
      "tests/test_flash_ffn_blackwell.py::test_auto_picks_mosaic_gpu_on_blackwell_once_measured"),
    m("mosaic_gpu_picked_where_measured_on_no_chip", "pallas_kernels/dispatch.py",
      "and capability[0] in MEASURED_FASTER.get(op, ())):", "):",
      "tests/test_frac_mosaic_gpu.py::test_auto_picks_the_gpu_kernel_per_chip",
      "tests/test_pack3d_mosaic_gpu.py::test_auto_takes_triton_on_hopper_until_mosaic_gpu_is_measured",
      "tests/test_flash_ffn_blackwell.py::test_auto_picks_mosaic_gpu_on_blackwell_once_measured"),
    m("flash_ffn_blackwell_counted_as_measured", "pallas_kernels/dispatch.py",
      'MEASURED_FASTER = {"mhffn": (HOPPER,),', 'MEASURED_FASTER = {"mhffn": (HOPPER, BLACKWELL),',
      "tests/test_flash_ffn_blackwell.py::test_auto_picks_mosaic_gpu_on_blackwell_once_measured"),
    m("flash_ffn_routed_not_measured", "pallas_kernels/dispatch.py",
      '"mhffn_routed": (HOPPER,)}', '"mhffn_routed": ()}',
      "tests/test_flash_ffn.py::test_auto_picks_mosaic_gpu_for_the_layers_routed_op_on_hopper"),
    # ------------------------------------------------------------------ warp-specialized forward
    # (A slot released too early is invisible to the interpreter, whose WGMMAs complete when
    # issued; released too late, the kernel deadlocks: neither makes a mutant worth a hang.)
    m("flash_ffn_ws_router_expert_by_chunk", "pallas_kernels/flash_ffn/mosaic_gpu_ws.py",
      "step_fn(_Step(ku_s.at[slot], v_s.at[slot], lax.div(n, chunks), lax.rem(n, chunks),",
      "step_fn(_Step(ku_s.at[slot], v_s.at[slot], lax.rem(n, chunks), lax.rem(n, chunks),",
      f"{FFN}::test_mosaic_gpu_warp_specialized_forward"),
    m("flash_ffn_ws_up_tile_over_gate_tile", "pallas_kernels/flash_ffn/mosaic_gpu_ws.py",
      "(u_ref, ku_s, bi, u_bar)", "(u_ref, ku_s, 0, u_bar)",
      f"{FFN}::test_mosaic_gpu_warp_specialized_forward"),
    m("flash_ffn_ws_consumers_share_tokens", "pallas_kernels/flash_ffn/mosaic_gpu_ws.py",
      "t0 = (lax.axis_index(\"i\") * CONSUMERS + wg) * bq", "t0 = (lax.axis_index(\"i\") + wg) * bq",
      f"{FFN}::test_mosaic_gpu_warp_specialized_forward"),
    m("flash_ffn_ws_gate_and_up_swapped", "pallas_kernels/flash_ffn/mosaic_gpu_ws.py",
      "a = weighted_activation(mn[:, :bi], mn[:, bi:],", "a = weighted_activation(mn[:, bi:], mn[:, :bi],",
      f"{FFN}::test_mosaic_gpu_warp_specialized_forward"),
    m("flash_ffn_ws_dq_dn_times_k", "pallas_kernels/flash_ffn/mosaic_gpu_ws.py",
      "plgpu.wgmma(acc, s.operand(dn, 1), s.ku.at[pl.ds(bi, bi)])",
      "plgpu.wgmma(acc, s.operand(dn, 1), s.ku.at[pl.ds(0, bi)])",
      f"{FFN}::test_mosaic_gpu_warp_specialized_forward"),
    m("flash_ffn_ws_dr_keeps_last_tile_only", "pallas_kernels/flash_ffn/mosaic_gpu_ws.py",
      "dr_w[s.e] = dr_w[s.e] + dr_e", "dr_w[s.e] = dr_e",
      f"{FFN}::test_mosaic_gpu_warp_specialized_forward"),
    m("flash_ffn_ws_da_from_q", "pallas_kernels/flash_ffn/mosaic_gpu_ws.py",
      "plgpu.wgmma(da_acc, ds_w, s.v.transpose((1, 0)))",
      "plgpu.wgmma(da_acc, q_w, s.v.transpose((1, 0)))",
      f"{FFN}::test_mosaic_gpu_warp_specialized_forward"),
    m("flash_ffn_ws_dv_times_q", "pallas_kernels/flash_ffn/mosaic_gpu_ws.py",
      "terms = [(weighted_activation(*products, r_e, sigmoid=tanh_sigmoid), ds_t)]",
      "terms = [(weighted_activation(*products, r_e, sigmoid=tanh_sigmoid), q_t)]",
      f"{FFN}::test_mosaic_gpu_warp_specialized_forward"),
    m("flash_ffn_ws_dkuv_router_of_expert_0", "pallas_kernels/flash_ffn/mosaic_gpu_ws.py",
      "plgpu.copy_gmem_to_smem(r_ref.at[h, e, t], r_s.at[slot], r_bar.at[slot])",
      "plgpu.copy_gmem_to_smem(r_ref.at[h, 0, t], r_s.at[slot], r_bar.at[slot])",
      f"{FFN}::test_mosaic_gpu_warp_specialized_forward"),
    m("flash_ffn_ws_dv_written_as_du", "pallas_kernels/flash_ffn/mosaic_gpu_ws.py",
      "write(pl.run_scoped(lambda acc: consume((acc,)), plgpu.ACC((rows, d), _F32)), 2)",
      "write(pl.run_scoped(lambda acc: consume((acc,)), plgpu.ACC((rows, d), _F32)), 1)",
      f"{FFN}::test_mosaic_gpu_warp_specialized_forward"),
    m("flash_ffn_mosaic_table_tile_pads_to_the_block", "pallas_kernels/flash_ffn/tiles.py",
      "  tiles = -(-d_e // block)\n", "  tiles = 1\n",
      f"{FFN}::test_mosaic_table_tile_pads_less_than_a_tile"),
    m("perf_half_differentiates_the_other_half", "benchmarks/aot/perf_programs.py",
      "own = [i for i, key in enumerate(paths) if key in names]",
      "own = [i for i, key in enumerate(paths)]",
      "tests/test_step_estimate.py::test_a_half_differentiates_its_own_parameters"),
    m("step_estimate_one_block_short", "benchmarks/aot/step_estimate.py",
      'compute = seconds["head"] + facts["layers"] * block',
      'compute = seconds["head"] + (facts["layers"] - 1) * block',
      "tests/test_step_estimate.py::test_step_is_the_sum_of_its_parts"),
    m("step_estimate_remat_forward_uncounted", "benchmarks/aot/step_estimate.py",
      'recompute = {h: 0.0 if facts["remat"] == "none" else seconds[f"{h}/fwd"] for h in HALVES}',
      "recompute = {h: 0.0 for h in HALVES}",
      "tests/test_step_estimate.py::test_step_is_the_sum_of_its_parts"),
    m("step_estimate_remat_mixer_core_recomputed", "benchmarks/aot/step_estimate.py",
      'recompute["mixer"] -= seconds[CORE_PART[spec["mixer"]]]', "pass",
      "tests/test_step_estimate.py::test_remat_mixer_recomputes_the_mixer_less_its_core"),
    m("step_estimate_gradients_not_scattered", "benchmarks/aot/step_estimate.py",
      "collectives = 3 * 4 * facts", "collectives = 2 * 4 * facts",
      "tests/test_step_estimate.py::test_step_is_the_sum_of_its_parts"),
    m("step_estimate_floor_unchecked", "benchmarks/aot/step_estimate.py",
      "    if seconds[name] < floor:", "    if False:",
      "tests/test_step_estimate.py::test_a_part_faster_than_its_flop_floor_is_flagged"),
    m("attention_chunks_score_every_key", "models/attention.py",
      "k_g, v_g, keys = k[:, :stop], v[:, :stop], jnp.arange(stop)",
      "k_g, v_g, keys = k, v, jnp.arange(length)",
      f"{LM}::test_query_chunks_attend_as_the_dense_form"),
    m("attention_group_keys_one_chunk_short", "models/attention.py",
      "    start, stop = first * chunk, min(length, (first + per_group) * chunk)",
      "    start, stop = first * chunk, min(length, (first + per_group) * chunk)\n"
      "    stop = max(start + 1, stop - 1) if stop < length else stop",
      f"{LM}::test_query_chunks_attend_as_the_dense_form"),
    m("flash_ffn_ws_tokens_pad_to_one_tile", "pallas_kernels/flash_ffn/tiles.py",
      "      tile = math.lcm(tile, bq * blocks.compute_wgs)", "      tile = tile",
      f"{FFN}::test_warp_specialized_tokens_pad_to_whole_ctas"),
    m("sass_retry_stubs_counted_as_loops", "benchmarks/aot/sass.py",
      "if i.op.startswith(\"BRA\") and i.addr < end and", "if i.op.startswith(\"BRA\") and",
      "tests/test_sass_report.py::test_main_loop_counts_per_iteration"),
    m("sass_a_from_registers_any_register", "benchmarks/aot/sass.py",
      'a_reg = bool(re.match(r"R\\d+, R\\d+,", i.args))', 'a_reg = bool(re.match(r"R\\d+,", i.args))',
      "tests/test_sass_report.py::test_main_loop_counts_per_iteration"),
    m("sass_registers_not_per_warp_granular", "benchmarks/aot/sass.py",
      "per_warp = math.ceil(registers * 32 / REG_UNIT) * REG_UNIT", "per_warp = registers * 32",
      "tests/test_sass_report.py::test_occupancy"),
    # ------------------------------------------------------------------ Blackwell (tcgen05)
    m("flash_ffn_blackwell_accumulator_not_reset", "pallas_kernels/flash_ffn/mosaic_gpu.py",
      "  return functools.reduce(jnp.logical_or, [i > 0 for i in idx])", "  return True",
      "tests/test_flash_ffn_blackwell.py::test_forward_and_grads_bf16"),
    m("blackwell_mma_not_awaited", "pallas_kernels/mosaic_gpu_common.py",
      "    plgpu.barrier_wait(acc.done)\n", "",
      "tests/test_flash_ffn_blackwell.py::test_forward_and_grads_bf16"),
    # The interpreter runs in program order: only the traced kernels' structure shows these.
    m("blackwell_tmem_load_not_fenced", "pallas_kernels/mosaic_gpu_common.py",
      "  plgpu.barrier_arrive(accs[0].done)\n", "",
      "tests/test_flash_ffn_blackwell.py::test_tensor_memory_loads_ordered_before_the_next_mma"),
    m("blackwell_tmem_load_not_awaited", "pallas_kernels/mosaic_gpu_common.py",
      "  plgpu.wait_load_tmem()\n", "",
      "tests/test_flash_ffn_blackwell.py::test_tensor_memory_loads_ordered_before_the_next_mma"),
    m("blackwell_dkuv_fit_ignores_products", "pallas_kernels/flash_ffn/mosaic_gpu.py",
      "fits = 3 * round_up(d, 8) + 3 * round_up(bk, 8) <= 512", "fits = 3 * round_up(d, 8) <= 512",
      "tests/test_flash_ffn_blackwell.py::test_dkuv_passes"),
    m("blackwell_dkuv_fit_power_of_two_columns", "pallas_kernels/flash_ffn/mosaic_gpu.py",
      "fits = 3 * round_up(d, 8) + 3 * round_up(bk, 8) <= 512",
      "fits = 3 * (1 << (d - 1).bit_length()) + 3 * (1 << (bk - 1).bit_length()) <= 512",
      "tests/test_flash_ffn_blackwell.py::test_dkuv_passes"),
    # ------------------------------------------------------------------ Pack3D far offset
    m("pack3d_reference_far_offset_dropped", "jaxops/pack3d.py",
      "s_far = s_far + jnp.asarray(far_offset, _F32)[None, :, None, None]", "s_far = s_far",
      f"{P3I}::test_pack3d_far_offset_forward_and_grads[reference-default]"),
    m("pack3d_xla_far_offset_dropped", "jaxops/pack3d.py",
      "s_far = s_far + far_offset[None, :, None, None]", "s_far = s_far",
      f"{P3I}::test_pack3d_far_offset_forward_and_grads[xla-default]"),
    m("pack3d_mosaic_fwd_far_offset_dropped", "pallas_kernels/pack3d_attention/mosaic.py",
      "cols_ref, off_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *, plan: TilePlan):\n"
      "  a, j = pl.program_id(0), pl.program_id(1)",
      "cols_ref, off_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *, plan: TilePlan):\n"
      "  a, j, off_ref = pl.program_id(0), pl.program_id(1), None",
      f"{P3I}::test_pack3d_far_offset_forward_and_grads[mosaic-default]"),
    m("pack3d_mosaic_dq_far_offset_dropped", "pallas_kernels/pack3d_attention/mosaic.py",
      "plan: TilePlan):\n  a, j = pl.program_id(0), pl.program_id(1)\n\n"
      "  @pl.when(j == 0)\n  def _():\n    dq_sc",
      "plan: TilePlan):\n  a, j, off_ref = pl.program_id(0), pl.program_id(1), None\n\n"
      "  @pl.when(j == 0)\n  def _():\n    dq_sc",
      f"{P3I}::test_pack3d_far_offset_forward_and_grads[mosaic-default]"),
    m("pack3d_mosaic_summary_grads_without_offset", "pallas_kernels/pack3d_attention/mosaic.py",
      "_far(plan, cols_ref, rows_ref, a, off_ref, h)", "_far(plan, cols_ref, rows_ref, a, None, h)",
      f"{P3I}::test_pack3d_far_offset_forward_and_grads[mosaic-default]"),
    m("pack3d_mosaic_d_far_offset_dropped", "pallas_kernels/pack3d_attention/mosaic.py",
      "doff_sc[h] += ds_sum", "doff_sc[h] += 0.0 * ds_sum",
      f"{P3I}::test_pack3d_far_offset_forward_and_grads[mosaic-default]"),
    m("pack3d_mosaic_d_far_offset_not_reset", "pallas_kernels/pack3d_attention/mosaic.py",
      "      doff_sc[...] = jnp.zeros_like(doff_sc)\n", "      pass\n",
      f"{KP}::test_no_races_and_no_uninitialized_reads[pack3d-far_offset]"),
    m("pack3d_kernel_d_far_offset_sign", "pallas_kernels/pack3d_attention/__init__.py",
      "d_offset = jnp.sum(grads[5], axis=(0, 2))[:, None, None]",
      "d_offset = -jnp.sum(grads[5], axis=(0, 2))[:, None, None]",
      f"{P3I}::test_pack3d_far_offset_forward_and_grads[mosaic-default]"),
    m("pack3d_triton_fwd_far_offset_dropped", "pallas_kernels/pack3d_attention/triton.py",
      "tiles.finish(*_summary_loop(plan, cols_ref, rows_ref, off_ref, far, state))",
      "tiles.finish(*_summary_loop(plan, cols_ref, rows_ref, None, far, state))",
      f"{P3I}::test_pack3d_far_offset_forward_and_grads[triton-default]"),
    m("pack3d_triton_dq_far_offset_dropped", "pallas_kernels/pack3d_attention/triton.py",
      "_summary_loop(plan, cols_ref, rows_ref, off_ref, far, dq)",
      "_summary_loop(plan, cols_ref, rows_ref, None, far, dq)",
      f"{P3I}::test_pack3d_far_offset_forward_and_grads[triton-default]"),
    m("pack3d_triton_d_far_offset_dropped", "pallas_kernels/pack3d_attention/triton.py",
      "carry[2] + ds_sum", "carry[2]",
      f"{P3I}::test_pack3d_far_offset_forward_and_grads[triton-default]"),
    m("pack3d_layer_far_offset_not_passed", "models/pack3d.py",
      "kwargs = dict(self.op_kwargs, far_offset=None if self.far_offset is None\n"
      "                  else self.far_offset[...].astype(jnp.float32))",
      "kwargs = dict(self.op_kwargs, far_offset=None)",
      "tests/test_pack3d_layer.py::test_far_offset_impls_agree_forward_and_gradients"),
    m("pack3d_layer_far_offset_starts_at_1", "models/pack3d.py",
      'param(jnp.zeros((num_heads,), param_dtype), "heads")',
      'param(jnp.ones((num_heads,), param_dtype), "heads")',
      "tests/test_pack3d_layer.py::test_far_offset_parameter"),
    m("pack3d_layer_far_offset_not_over_heads", "models/pack3d.py",
      'param(jnp.zeros((num_heads,), param_dtype), "heads")',
      "param(jnp.zeros((num_heads,), param_dtype), None)",
      "tests/test_pack3d_layer.py::test_far_offset_splits_over_heads_under_shard_layer"),
    m("pack3d_default_far_offset_on", "models/pack3d.py",
      "far_offset: bool = False", "far_offset: bool = True",
      "tests/test_pack3d_layer.py::test_far_offset_parameter"),
    # FlashFFN as a drop-in: [..., d] folded to [B, L, d] and back
    m("flashffn_unfolded_in_another_order", "models/flash_ffn.py",
      "    return y.reshape(x.shape)", "    return jnp.swapaxes(y, 0, 1).reshape(x.shape)",
      f"{FFN}::test_swiglu_has_the_same_signature"),
    m("rms_expand_repeat_wrong_axis", "jaxops/rms_norm.py",
      "jnp.repeat(v, width // v.shape[-1], axis=-1)",
      "jnp.tile(v, width // v.shape[-1])",
      f"{FFN}::test_group_expansion_forms_agree"),
    m("pack3d_xla_cube_means_by_gemm", "jaxops/pack3d.py",
      "  kbar = jnp.sum(k32, axis=2) * inv_n",
      "  kbar = jnp.einsum('bcthd,t->bchd', k32, jnp.ones(k32.shape[2], k32.dtype)) * inv_n",
      "tests/test_pack3d.py::test_xla_path_cube_summaries_are_sums_not_matmuls"),
    # the training binaries' command line
    m("cli_rejected_config_keeps_its_workdir", "train/cli.py",
      "            _remove_if_empty(workdir())", "            pass",
      "tests/test_trainer_binary_errors.py::test_a_rejected_config_leaves_no_empty_workdir"),
    m("pack3d_reference_cube_sums_of_the_wrong_cube", "jaxops/pack3d.py",
      "num_segments=ids.shape[0])[ids]", "num_segments=ids.shape[0])[ids[::-1]]",
      "tests/test_pack3d.py::test_reference_cube_means_are_segment_sums_not_matmuls"),
    m("decay_mask_ignores_linen_marks", "train/optim.py",
      'getattr(x, "metadata", {}).get("weight_decay", True)', "True",
      "tests/test_readme.py::test_readme_section_runs"),
    m("impl_backend_not_passed_to_the_kernel", "models/impl.py",
      '    options["backend"] = backend', "    pass",
      "tests/test_api.py::test_backend_reaches_the_kernel_and_makes_auto_the_kernel"),
    # RESULTS.md's headlines against the report code and the json
    m("results_headline_interval_stale", "RESULTS.md",
      "(+0.42 [+0.02, +0.81], 3 seeds)", "(+0.43 [+0.02, +0.81], 3 seeds)",
      "tests/test_results_headlines.py::test_every_headline_interval_is_printed_by_the_report"),
    m("results_memory_clock_three_seeds", "RESULTS.md",
      "FRAC's power law keeps 0.22-0.44 (6 seeds)", "FRAC's power law keeps 0.27-0.44 (6 seeds)",
      "tests/test_results_headlines.py::test_memory_clock_ranges_over_every_seed"),
    m("optimizer_state_replicated", "train/trainer.py",
      "init = jax.jit(tx.init, out_shardings=sharding.optimizer_shardings(tx, params, mesh))",
      "init = jax.jit(tx.init)",
      "tests/test_param_sharding.py::test_optimizer_state_is_sharded_like_the_parameters"),
    m("lm_remat_ignored", "models/lm.py",
      '  if remat == "none":\n    return block(x)\n',
      "  return block(x)\n",
      "tests/test_lm.py::test_remat_keeps_less_for_the_backward"),
    # make perf-tpu's reading of its rows
    m("perf_parts_not_summed", "benchmarks/aot/perf.py",
      "row[field] = sum(r[field] for r in results)", "row[field] = results[-1][field]",
      "tests/test_perf_tpu.py::test_a_row_of_parts_sums_their_compiles"),
    m("perf_part_failure_ignored", "benchmarks/aot/perf.py",
      "  if failed:\n", "  if False:\n",
      "tests/test_perf_tpu.py::test_a_row_of_parts_sums_their_compiles"),
    m("perf_reading_ignores_hbm_floor", "benchmarks/aot/perf.py",
      "read_us=max(estimate, floor)", "read_us=estimate",
      "tests/test_perf_tpu.py::test_reading_takes_the_larger_of_estimate_and_hbm_floor"),
    # ------------------------------------------------------------------ the installed package
    m("config_name_not_resolved", "configs/__init__.py",
      "  if name in names():\n", "  if False:\n",
      "tests/test_cli.py::test_training_prints_the_parameter_count_and_training_rates"),
    m("config_load_error_not_caught", "train/cli.py",
      "    configs.load(spec)\n", "    pass\n",
      "tests/test_trainer_binary_errors.py::test_bad_input_is_one_clear_line"),
    m("data_path_kept_relative", "train/lm_task.py",
      "config.data.path = os.path.abspath(config.data.path)",
      "config.data.path = config.data.path",
      "tests/test_installed_package.py::"
      "test_console_script_trains_a_packaged_config_and_the_workdir_loads_back"),
    m("frac_step_cache_unchecked", "models/frac.py",
      "    self._check_cache(cache, x_t.shape[0])\n", "",
      "tests/test_bad_inputs.py::test_bad_input_names_the_argument"),
    m("layer_options_unchecked", "jaxops/checks.py",
      "  if unknown := sorted(set(given) - takes):", "  if unknown := []:",
      "tests/test_bad_inputs.py::test_bad_input_names_the_argument"),
    m("kernel_body_answers_xla_for_a_tpu", "models/impl.py",
      "if platform not in (None, jax.default_backend()) and on_xla:",
      "if platform not in (None, jax.default_backend()) and not on_xla:",
      "tests/test_bad_inputs.py::test_bad_input_names_the_argument",
      "tests/test_kernel_table.py::test_kernel_body_answers_for_other_chips_from_this_machine"),
    m("pack_fields_width_unchecked", "jaxops/packing.py",
      "  if width is not None and lead[-1] != width:", "  if False:",
      "tests/test_bad_inputs.py::test_bad_input_names_the_argument"),
]


_NOT_COPIED = (".git", ".venv*", "__pycache__", ".pytest_cache", "runs", "workdir*",
               "*.egg-info")


def copy_tree(repo: pathlib.Path, dest: pathlib.Path) -> None:
  """Copies git's tracked plus untracked-but-not-ignored files (or, outside a git checkout,
  everything but virtual environments, caches and run outputs)."""
  out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo,
                       capture_output=True)
  if out.returncode:
    shutil.copytree(repo, dest, ignore=shutil.ignore_patterns(*_NOT_COPIED))
    return
  for rel in out.stdout.decode().split("\0"):
    if rel and (repo / rel).is_file():
      (dest / rel).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(repo / rel, dest / rel)


def check(mutant: Mutant, root: pathlib.Path) -> str | None:
  """Why `mutant` does not apply under `root`, or None."""
  path = root / mutant.path
  if not path.is_file():
    return f"{mutant.path} does not exist"
  count = path.read_text().count(mutant.old)
  if count != 1:
    return f"snippet found {count} times in {mutant.path} (expected once)"
  for test in mutant.tests:
    file, _, name = test.partition("::")
    if not (root / file).is_file():
      return f"test file {file} does not exist"
    # pytest reports a missing test id as an error, which would count the mutant as killed
    if name and f"def {name.split('[')[0]}(" not in (root / file).read_text():
      return f"{test} does not exist"
  return None


def run_pytest(copy: pathlib.Path, tests, timeout: float) -> tuple[bool, str, float]:
  """(passed, first failing test or error summary, seconds) of pytest -x -q in `copy`."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONDONTWRITEBYTECODE": "1",
         "PYTHONPATH": str(copy)}
  start = time.time()
  try:
    out = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                          *tests], cwd=copy, env=env, capture_output=True, text=True,
                         timeout=timeout)
  except subprocess.TimeoutExpired:
    return False, "timeout", time.time() - start
  seconds = time.time() - start
  if out.returncode == 0:
    return True, "", seconds
  if out.returncode == 5:  # every named test deselected (marked slow): nothing was checked
    return True, "no test ran (all deselected)", seconds
  failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out.stdout, re.M)
  return False, failed[0] if failed else f"pytest exit {out.returncode}", seconds


def run_mutant(mutant: Mutant, copy: pathlib.Path, timeout: float) -> tuple[bool, str, float]:
  path = copy / mutant.path
  original = path.read_text()
  path.write_text(original.replace(mutant.old, mutant.new, 1))
  try:
    return run_pytest(copy, mutant.tests, timeout)
  finally:
    path.write_text(original)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("prefixes", nargs="*", help="run mutants whose name starts with these")
  parser.add_argument("--check", action="store_true", help="only check that snippets apply")
  parser.add_argument("--list", action="store_true", help="list the mutants and exit")
  parser.add_argument("--jobs", type=int, default=1)
  parser.add_argument("--no-baseline", action="store_true")
  parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
  parser.add_argument("--touching", nargs="+", metavar="TEST_FILE",
                      help="only the mutants whose own tests include one of these files")
  parser.add_argument("--tests", nargs="+", help="run every mutant against these tests "
                      "instead of its own (e.g. to see what an older test file misses)")
  args = parser.parse_args(argv)

  mutants = [mu for mu in MUTANTS
             if not args.prefixes or any(mu.name.startswith(p) for p in args.prefixes)]
  if args.touching:
    mutants = [mu for mu in mutants
               if any(t.partition("::")[0] in args.touching for t in mu.tests)]
  if args.tests:
    mutants = [dataclasses.replace(mu, tests=tuple(args.tests)) for mu in mutants]
  if args.list:
    for mu in mutants:
      print(f"{mu.name:45s} {mu.path:38s} {' '.join(mu.tests)}")
    return 0
  stale = [(mu, why) for mu in mutants if (why := check(mu, REPO))]
  for mu, why in stale:
    print(f"STALE  {mu.name}: {why}")
  if args.check or stale:
    print(f"{len(mutants) - len(stale)}/{len(mutants)} mutants apply")
    return 1 if stale else 0

  with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
    copies = []
    for j in range(max(1, min(args.jobs, len(mutants)))):
      copies.append(pathlib.Path(tmp) / f"copy{j}")
      copy_tree(REPO, copies[-1])
    probe = subprocess.run([sys.executable, "-c",
                            "import neurips26_jax.jaxops as j; print(j.__file__)"],
                           cwd=copies[0], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(copies[0])})
    if not probe.stdout.startswith(str(copies[0])):
      print(f"the copy does not import its own code: {probe.stdout or probe.stderr}")
      return 1
    if not args.no_baseline:
      tests = sorted({t for mu in mutants for t in mu.tests})
      ok, failed, seconds = run_pytest(copies[0], tests, args.timeout * 4)
      print(f"baseline (unmutated, {len(tests)} test selections): "
            f"{'pass' if ok else 'FAIL ' + failed} in {seconds:.0f}s", flush=True)
      if not ok:
        return 1

    free = list(copies)
    results = {}

    def work(mu):
      copy = free.pop()
      try:
        return mu, run_mutant(mu, copy, args.timeout)
      finally:
        free.append(copy)

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(copies)) as pool:
      for mu, (passed, failed, seconds) in pool.map(work, mutants):
        results[mu.name] = passed
        verdict = (f"SURVIVED{f' ({failed})' if failed else ''}" if passed
                   else f"killed by {failed}")
        print(f"{mu.name:45s} {verdict}  ({seconds:.0f}s)", flush=True)

  survivors = [name for name, passed in results.items() if passed]
  print(f"\n{len(results) - len(survivors)}/{len(results)} mutants killed"
        + (f"; survivors: {', '.join(survivors)}" if survivors else ""))
  return 1 if survivors else 0


if __name__ == "__main__":
  sys.exit(main())
