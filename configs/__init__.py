"""ml_collections configs, one file per experiment."""
