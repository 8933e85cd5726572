"""Training: absl binaries, data, sharding, checkpointing, metrics."""
