"""Ready-made data and models for the jobs and notebooks (needs the `examples` extra)."""
