"""LanguageModel: decoding (KV cache / recurrent state) against the full forward, options,
errors; the model and its causal attention against their formulas in float64 numpy
(tests/layer_formula_checks.py), and their initialisation."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from neurips26_jax.models.attention import CausalAttention
# imported, not skipped: an import error must fail here
import neurips26_jax.models.frac  # noqa: F401
from neurips26_jax.models.lm import LanguageModel
from tests.layer_formula_checks import (P, build, close, normal, randomize, rms_norm, rngs,
                                         rope_1d, run, stats_match, swiglu_numpy)

FFNS = {"swiglu": {"d_ff": 48}, "flashffn": {"num_heads": 2, "num_experts": 2, "d_expert": 16}}


@functools.cache      # one model per configuration, shared by the tests (none mutates it)
def tiny(mixer="attention", ffn="swiglu", **kwargs):
  options = {"frac": {"head_dim": 8, "state_dim": 8}, "mamba2": {"head_dim": 8, "state_dim": 8},
             "attention": {}}[mixer]
  return LanguageModel(d_model=32, num_layers=2, num_heads=2, context=24, mixer=mixer, ffn=ffn,
                       mixer_options=options, ffn_options=FFNS[ffn], rngs=rngs(), **kwargs)


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


# Each mixer decodes with one FFN, each FFN in two mixers: a block's FFN acts on each position
# alone, the same in `step` as in the forward, whatever the mixer.
def test_attention_decoding_matches_forward():
  check_decoding(tiny())


@pytest.mark.parametrize("mixer, ffn", [("frac", "flashffn"), ("mamba2", "swiglu")])
def test_recurrent_decoding_matches_forward(mixer, ffn):
  check_decoding(tiny(mixer, ffn, impl="xla"))


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
  np.testing.assert_allclose(run(bf16, tokens), run(f32, tokens), atol=0.15)


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


# ----------------------------------------------------------------------------- formulas and init

def causal_attention_numpy(layer, x, theta=10000.0):
  """models/attention.py's docstring: projections, 1D RoPE on t = 0..L-1, causal softmax."""
  wq, wk, wv, wo = (P(w) for w in (layer.wq, layer.wk, layer.wv, layer.wo))
  q, k, v = (np.einsum("bld,dhk->blhk", x, w) for w in (wq, wk, wv))
  positions = np.arange(x.shape[1], dtype=np.float64)
  q, k = rope_1d(q, positions, theta), rope_1d(k, positions, theta)
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
  logits = np.where(np.tril(np.ones((x.shape[1],) * 2, bool)), logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  o = np.einsum("bhqk,bkhd->bqhd", probs, v)
  return np.einsum("bqhd,hdm->bqm", o, wo)


def test_causal_attention_formula_and_init():
  layer = build(CausalAttention, 32, 2, context=64)
  x = normal(1, (2, 40, 32))
  close(run(layer, x.astype(np.float32)), causal_attention_numpy(layer, x))
  for name in ("wq", "wk", "wv", "wo"):     # normal(0, d^-1/2)
    stats_match(getattr(layer, name)[...], std=32 ** -0.5, name=name)


def test_query_chunks_attend_as_the_dense_form():
  """query_chunk=16 over L=40 (the last chunk padded; 3 key groups of one chunk): the
  formula, and the gradients of x and every weight equal to the dense form's (one chunk);
  the default chunk's rule."""
  from neurips26_jax.models.attention import default_query_chunk
  chunked = build(CausalAttention, 32, 2, context=64, query_chunk=16)
  x = normal(1, (2, 40, 32)).astype(np.float32)
  state = nnx.state(chunked)
  dense = nnx.graphdef(nnx.eval_shape(      # the same weights in one chunk
      lambda: CausalAttention(32, 2, context=64, query_chunk=64, rngs=rngs())))

  def outputs_and_grads(graphdef):
    """(lowered text, y, gradients of sum(sin(y)) for x and every weight): one program."""
    def f(s, x):
      y, vjp = jax.vjp(lambda s, x: nnx.merge(graphdef, s)(x), s, x)
      return y, vjp(jnp.cos(y))
    lowered = jax.jit(f).lower(state, jnp.asarray(x))
    y, grads = lowered.compile()(state, jnp.asarray(x))
    return lowered.as_text(), y, jax.tree.leaves(grads)
  text, y, grads = outputs_and_grads(nnx.graphdef(chunked))
  close(y, causal_attention_numpy(chunked, x))
  _, _, grads_dense = outputs_and_grads(dense)
  for g, g_dense in zip(grads, grads_dense, strict=True):
    np.testing.assert_allclose(g, g_dense, rtol=1e-4,
                               atol=1e-5 * float(jnp.max(jnp.abs(g_dense))))
  # The backward recomputes one chunk's scores [B, H, 16, L]: never [B, H, L, L], nor the
  # three chunks' scores stacked for it.
  assert "2x2x16x40xf32" in text and "2x2x40x40xf32" not in text and "x2x2x16x40xf32" not in text
  # the second chunk (queries 16-31) scores only the keys before its group's end: 32, not 40
  assert "2x2x16x32xf32" in text
  assert [default_query_chunk(12, n) for n in (1024, 4096, 32768)] == [2048, 512, 64]


def test_language_model_formula_and_init():
  """tokens -> embedding -> pre-norm blocks (attention, SwiGLU) -> RMSNorm -> head."""
  model = build(LanguageModel, d_model=16, num_layers=2, num_heads=2, context=32,
                ffn_options={"d_ff": 24})
  for i, norm in enumerate([model.norm] + [n for b in model.blocks for n in (b.norm1, b.norm2)]):
    randomize(norm.scale, 20 + i)
  tokens = np.random.default_rng(1).integers(0, 256, (2, 11)).astype(np.int32)
  x = P(model.embed)[tokens]
  for block in model.blocks:
    x = x + causal_attention_numpy(block.mixer, rms_norm(x, P(block.norm1.scale)))
    x = x + swiglu_numpy(block.ffn, rms_norm(x, P(block.norm2.scale)))
  expected = rms_norm(x, P(model.norm.scale)) @ P(model.head)
  logits = run(model, tokens)
  assert logits.dtype == jnp.float32
  close(logits, expected)
  # init: embedding normal(0, 1), head normal(0, d^-1/2); the FRAC mixer gets the context
  stats_match(model.embed[...], std=1.0, name="embed")
  stats_match(model.head[...], std=16 ** -0.5, name="head")
  frac = nnx.eval_shape(lambda: LanguageModel(
      d_model=16, num_layers=1, num_heads=2, context=4096, mixer="frac",
      mixer_options={"head_dim": 8, "state_dim": 4}, ffn_options={"d_ff": 8},
      rngs=rngs()))
  mixer = frac.blocks[0].mixer
  assert (mixer.context, mixer.num_heads, mixer.num_modes) == (4096, 2, 16)


def test_remat_recomputes_blocks_with_the_same_gradients():
  """remat=True ("full"): the same loss gradients (to float32 rounding: jitted, XLA fuses the
  two programs differently; within 1e-5 of each array's largest entry). "mixer" changes only
  what is saved, not the math (its test below counts what it keeps). Attention + FlashFFN
  blocks: remat wraps whole blocks whatever their mixer, and FRAC's custom-VJP scan costs
  three times as much to compile."""
  tokens = jnp.arange(32).reshape(2, 16) % 256

  def grads(model):
    graphdef, state = nnx.split(model)
    return jax.tree.leaves(jax.jit(jax.grad(
        lambda s: jnp.mean(nnx.merge(graphdef, s)(tokens) ** 2)))(state))
  plain = grads(tiny("attention", "flashffn", impl="xla"))
  for a, b in zip(plain, grads(tiny("attention", "flashffn", impl="xla", remat=True)),
                  strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(a))))


def test_remat_keeps_less_for_the_backward():
  """What remat is for: the residuals the backward keeps (4 attention + SwiGLU blocks at
  256 tokens: 169 arrays without, 49 with, of which [.., 256, ..]-sized 128 and 12); "mixer"
  keeps one more per block, the heads' outputs named "attention". Read from the jaxpr
  (`print_saved_residuals`): what XLA then allocates differs by version (the CPU compile's
  temporaries fall 16.4 -> 4.5 MB on jax 0.12, barely on 0.10)."""
  import contextlib
  import io

  from jax import ad_checkpoint

  def residuals(remat):
    model = nnx.eval_shape(lambda: LanguageModel(d_model=32, num_layers=4, num_heads=2,
                                                 context=256, impl="xla", remat=remat,
                                                 rngs=nnx.Rngs(0)))     # traced, never run
    graphdef, state = nnx.split(model)
    loss = lambda s: jnp.mean(nnx.merge(graphdef, s)(jnp.zeros((2, 256), jnp.int32)) ** 2)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
      ad_checkpoint.print_saved_residuals(loss, state)
    return [line for line in printed.getvalue().splitlines() if line.strip()]
  full = residuals(True)
  assert len(full) < 0.4 * len(residuals(False))
  extra = [line for line in residuals("mixer") if line not in full]
  assert len(extra) == 4 and all("named 'attention'" in line for line in extra), extra


@pytest.mark.parametrize("mixer, options, body, full, kept", [
    ("frac", {}, "tpu_custom_call", 6, 4),       # the scan kernel: fwd, recompute, bwd
    ("attention", {"query_chunk": 16}, "stablehlo.while", 24, 16)])  # query-chunk loops
def test_remat_mixer_keeps_the_mixer_core_out_of_the_recomputation(mixer, options, body,
                                                                   full, kept):
  """remat="mixer" saves what the mixers name `MIXER_CORE`: in the gradient of 2 blocks
  exported for a TPU, the FRAC scan kernel runs twice per block (forward, backward) instead
  of three times, and attention's loops over its query chunks (4 groups of 16 queries) run
  in the forward and backward only (8 + 8 loops, as without remat), not again in the
  recomputation."""
  from tests import kernel_checks
  counts = {}
  for remat in ("full", "mixer"):
    model = nnx.eval_shape(lambda: LanguageModel(  # exported from shapes, never run
        d_model=32, num_layers=2, num_heads=2, context=64, mixer=mixer, mixer_options=options,
        remat=remat, impl="pallas", rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    tokens = jnp.arange(64)[None] % 256
    grad = jax.grad(lambda s: jnp.mean(nnx.merge(graphdef, s)(tokens) ** 2))
    counts[remat] = kernel_checks.export_mlir(grad, "tpu", state).count(body)
  assert (counts["full"], counts["mixer"]) == (full, kept)


def test_remat_names_its_policies():
  with pytest.raises(ValueError, match=r"`remat` must be one of \(False, True, 'none', "
                                       r"'full', 'mixer'\), got 'some'"):
    LanguageModel(d_model=32, num_layers=1, num_heads=2, context=16, remat="some",
                  rngs=nnx.Rngs(0))


def test_lm_loss_chunks_a_large_vocabulary(monkeypatch):
  """train.lm_task.lm_loss on a LanguageModel: the masked cross entropy of its logits, with
  the logits of a large vocabulary computed a chunk at a time (128 positions here): the
  jitted gradient never forms the [B, L, V] float32 logits."""
  from neurips26_jax.train import lm_task, losses
  monkeypatch.setattr(losses, "LOGIT_ELEMENTS", 128 * 512)
  model = build(LanguageModel, d_model=32, num_layers=1, num_heads=2, context=300,
                vocab_size=512, impl="xla")
  tokens = jax.random.randint(jax.random.key(0), (2, 300), 0, 512)
  batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}
  loss, expected = nnx.jit(lambda m, b: (
      lm_task.lm_loss(m, b)[0], losses.masked_cross_entropy(m(b["inputs"]), b["targets"])[0]))(
          model, batch)
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  graphdef, state = nnx.split(model)
  grad = jax.jit(jax.grad(lambda s: lm_task.lm_loss(nnx.merge(graphdef, s), batch)[0]))
  text = grad.lower(state).as_text()
  assert "2x300x512xf32" not in text and "2x128x512xf32" in text


@pytest.mark.parametrize("size, millions", [("125m", 135), ("370m", 369), ("1.3b", 1342)])
def test_paper_configs_build_at_their_sizes(size, millions):
  """configs/lm_paper.py: every mixer x FFN of a size holds its parameter count within 2%
  (abstract models: nothing is allocated); the counts include the 32k-vocabulary embedding
  and head."""
  from neurips26_jax.configs import lm_paper
  for mixer in ("attention", "frac"):
    for ffn in ("swiglu", "flashffn"):
      kwargs = dict(lm_paper.get_config(size).model.to_dict(), mixer=mixer, ffn=ffn)
      model = nnx.eval_shape(lambda: LanguageModel(**kwargs, rngs=nnx.Rngs(0)))
      count = sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
      assert abs(count / 1e6 - millions) <= 0.02 * millions, (mixer, ffn, count)
