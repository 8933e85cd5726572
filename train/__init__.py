"""Training: absl binaries, data, sharding, checkpointing, metrics; and the way back from a
run's workdir to its model:

  model, config = train.load_model("runs/lm")     # config.json + the newest good checkpoint
  train.evaluate(model, config)                   # {"eval_loss": ...}, as the trainer logs it
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the lazy exports' own signatures, for type checkers (no import at run time)
  from neurips26_jax.train.inference import evaluate, load_config, load_model

_EXPORTS = {name: "neurips26_jax.train.inference"
            for name in ("load_model", "load_config", "evaluate")}


def __getattr__(name: str) -> Any:
  """The exports above, imported on first use (importing `train` itself stays free)."""
  if name in _EXPORTS:
    import importlib  # noqa: PLC0415
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_EXPORTS)
