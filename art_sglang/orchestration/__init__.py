"""Orchestration: a training step across the trainer and the inference servers."""
