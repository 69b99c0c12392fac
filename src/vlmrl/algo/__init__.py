"""The GRPO-family math: advantages, policy losses and their aggregation, micro-batching, the rollout-training mismatch,
DAPO's dynamic sampling.

Pure tensor functions over config values; nothing here loads a model or touches a process group."""
