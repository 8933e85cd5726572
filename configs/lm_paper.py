"""Language models at the FlashFFN paper's sizes, for a TPU slice (and the repository's
`benchmarks/aot/scale.py`, which compiles their train step for one without the chips).

  neurips26-train-lm --config=lm_paper:370m --workdir=gs://.../run \
      --config.model.ffn=swiglu --config.model.mixer=frac

Sizes (GPT-3's shapes, which the paper's 125M / 350M / 1.3B models follow), `SIZES`:
  125m  d = 768,  12 layers, 12 attention heads
  370m  d = 1024, 24 layers, 16 attention heads
  1.3b  d = 2048, 24 layers, 16 attention heads
FlashFFN takes its defaults (heads of width 128, E and d_e from SwiGLU's parameter count), so
either FFN gives the same parameter count. Vocabulary 32,768 (the text pipeline here feeds
bytes, ids < 256, until a tokenizer is plugged in), context 4,096, bf16 compute with float32
parameters, every block rematerialised keeping its mixer's core (remat "mixer": 9-10% shorter
steps than "full" at 125M on v5e-16, and every size fits a v5e-16 at 4k; at 32k a FRAC model's
chunk-start states make it 2x the memory of "full", so there pass
`--config.model.remat=full`; the repository's benchmarks/README.md), the batch and the
parameters split over every chip (fsdp), AdamW at GPT-3's learning rate for the size.
"""

import ml_collections

from neurips26_jax.configs import lm_smoke

SIZES = {"125m": dict(d_model=768, num_layers=12, num_heads=12, lr=6e-4),
         "370m": dict(d_model=1024, num_layers=24, num_heads=16, lr=3e-4),
         "1.3b": dict(d_model=2048, num_layers=24, num_heads=16, lr=2e-4)}


def get_config(size: str = "370m"):
  if size not in SIZES:
    raise ValueError(f"lm_paper: the size after ':' must be one of {tuple(SIZES)}, "
                     f"got {size!r}")
  shape = dict(SIZES[size])
  lr = shape.pop("lr")
  c = lm_smoke.get_config()
  c.steps = 20_000
  c.batch_size = 256                    # sequences per step, over all chips
  c.compute_dtype = "bfloat16"
  c.log_every = 20
  c.eval_every = 1_000
  c.eval_batches = 16
  c.checkpoint_every = 1_000
  c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 1})
  c.optim.update({"lr": lr, "warmup_steps": 2_000, "min_lr_ratio": 0.1})
  c.data.max_bytes = 0
  c.model = ml_collections.ConfigDict({
      "vocab_size": 32_768, **shape, "context": 4_096, "mixer": "attention", "ffn": "flashffn",
      "mixer_options": {}, "ffn_options": {}, "impl": "auto", "remat": "mixer"})
  c.sample = ml_collections.ConfigDict({"prompt": "def ", "num_tokens": 64, "temperature": 0.0})
  return c
