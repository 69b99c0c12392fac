"""Rollout backends other than the in-process engine (models/rollout.py): vLLM colocated in the training process."""
