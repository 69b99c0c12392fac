"""Models: loading any local Hugging Face VLM, its processor, family fast paths, per-token log-probs without
full-vocabulary logits, the shared prompt prefix, MoE routers, and the rollout decoders (HF generate loop, continuous batching)."""
