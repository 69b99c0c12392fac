"""Offline tiny models: random-weight VLMs of every family at toy sizes (real architectures, offline tokenizers and
processors), built in seconds for tests, the demo, `vlmrl tiny` and the planner's trace mode. No hub access.
Real-size presets live in vlmrl.plan.presets, processor stand-ins in vlmrl.processors."""
