"""Models: loading any local Hugging Face VLM, its processor, family fast paths, per-token log-probs without
full-vocabulary logits, the shared prompt prefix, MoE routers, and the rollout engines (HF generate loop, continuous batching)."""
