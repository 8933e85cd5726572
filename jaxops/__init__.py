"""Pure-functional math: readable references and fast XLA paths (no Pallas imports)."""
