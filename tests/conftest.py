"""Suite-wide set-up: 8 simulated CPU devices (for sharding tests) and float32 matmuls."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (after XLA_FLAGS)

jax.config.update("jax_default_matmul_precision", "highest")
