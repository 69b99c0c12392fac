"""Checkpoints: atomic files that never lose work, a run's full state saved and restored, safe loading that never runs code."""
