"""Rollout backends other than the in-process decoder (models/rollout.py): vLLM colocated in the training process,
or in a `vlmrl rollout-server` process (server mode: its client, server and wire format); the rollout pipeline of
rollout.max_staleness > 0 (a producer process sampling ahead of the update)."""
