"""Storage: a model's files on disk (layout, history, the run lock)."""
