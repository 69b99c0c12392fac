"""The memory planner: per-device peak of a GRPO or SFT step before launch (closed form, one function per memory
term, and trace), trainer profiles, DeepSpeed ZeRO buffers, search and auto-fit, `vlmrl plan`."""
