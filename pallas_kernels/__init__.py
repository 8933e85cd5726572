"""Pallas kernels (TPU Mosaic, GPU Triton, CPU interpret), each behind jax.custom_vjp."""
