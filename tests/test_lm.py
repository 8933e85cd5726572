"""LanguageModel: decoding (KV cache / recurrent state) against the full forward, options, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models.frac  # noqa: F401  (imported, not skipped: an import error must fail here)
from models.lm import LanguageModel

FFNS = {"swiglu": {"d_ff": 48}, "flashffn": {"num_heads": 2, "num_experts": 2, "d_expert": 16}}


def tiny(mixer="attention", ffn="swiglu", **kwargs):
  options = {"frac": {"head_dim": 8, "state_dim": 8}, "mamba2": {"head_dim": 8, "state_dim": 8},
             "attention": {}}[mixer]
  return LanguageModel(d_model=32, num_layers=2, num_heads=2, context=24, mixer=mixer, ffn=ffn,
                       mixer_options=options, ffn_options=FFNS[ffn], rngs=nnx.Rngs(0), **kwargs)


def check_decoding(model):
  """Greedy generate = argmax of the forward at every position; step logits = forward logits."""
  prompt = jnp.array([[10, 20, 30], [40, 50, 60]])
  out = model.generate(prompt, 13)
  assert out.shape == (2, 16)
  np.testing.assert_array_equal(out[:, :3], prompt)
  logits = nnx.jit(lambda m, t: m(t))(model, out)
  np.testing.assert_array_equal(jnp.argmax(logits[:, 2:-1], -1), out[:, 3:])

  def run_steps(model, tokens):
    step = lambda cache, tok: model.step(tok, cache)[::-1]
    return jax.lax.scan(step, model.init_cache(tokens.shape[0]), tokens.T)[1].transpose(1, 0, 2)

  stepped = nnx.jit(run_steps)(model, out)
  np.testing.assert_allclose(stepped, logits, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("ffn", sorted(FFNS))
def test_attention_decoding_matches_forward(ffn):
  check_decoding(tiny("attention", ffn, impl="xla"))


@pytest.mark.parametrize("mixer", ["frac", "mamba2"])
def test_recurrent_decoding_matches_forward(mixer):
  check_decoding(tiny(mixer, "flashffn", impl="xla"))


def test_sampling_is_seeded_and_in_vocab():
  model = tiny()
  a = model.generate(jnp.array([[1, 2]]), 10, temperature=1.0, seed=3)
  b = model.generate(jnp.array([[1, 2]]), 10, temperature=1.0, seed=3)
  np.testing.assert_array_equal(a, b)
  assert int(a.min()) >= 0 and int(a.max()) < 256


def test_bf16_compute_keeps_f32_params_and_is_close():
  tokens = jnp.arange(40).reshape(2, 20) % 256
  f32, bf16 = tiny(), tiny(dtype=jnp.bfloat16)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(bf16, nnx.Param)))
  np.testing.assert_allclose(bf16(tokens), f32(tokens), atol=0.15)


@pytest.mark.parametrize("mixer", ["attention", "frac", "mamba2"])
@pytest.mark.parametrize("ffn", ["swiglu", "flashffn"])
def test_builds_without_options_at_the_default_parameter_count(mixer, ffn):
  """The four required sizes suffice for every mixer and FFN, and the sizes the rules derive
  give attention + SwiGLU's parameter count within 2% (models/lm.py's docstring)."""
  count = lambda m: sum(p.size for p in jax.tree.leaves(nnx.state(m, nnx.Param)))
  build = lambda mixer, ffn: nnx.eval_shape(lambda: LanguageModel(
      d_model=128, num_layers=2, num_heads=4, context=64, mixer=mixer, ffn=ffn,
      rngs=nnx.Rngs(0)))
  model, reference = build(mixer, ffn), build("attention", "swiglu")
  assert abs(count(model) / count(reference) - 1) < 0.02, (count(model), count(reference))
  if ffn == "flashffn":                          # head width 128, not the mixer's 32
    assert model.blocks[0].ffn.num_heads == 1


@pytest.mark.parametrize("kwargs, field", [({"mixer": "lstm"}, "mixer"), ({"ffn": "moe"}, "ffn"),
                                           ({"impl": "cuda"}, "impl"),
                                           ({"num_layers": 0}, "num_layers")])
def test_bad_arguments_name_the_field(kwargs, field):
  args = dict(d_model=32, num_layers=1, num_heads=2, context=8, rngs=nnx.Rngs(0),
              ffn_options={"d_ff": 32})
  with pytest.raises(ValueError, match=field):
    LanguageModel(**{**args, **kwargs})


def test_generate_beyond_the_kv_cache_fails():
  with pytest.raises(ValueError, match="context"):
    tiny().generate(jnp.zeros((1, 20), jnp.int32), 10)

