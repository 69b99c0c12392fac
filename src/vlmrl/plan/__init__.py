"""The memory planner: per-device peak of a GRPO or SFT step before launch (closed form and trace), trainer
profiles, search and auto-fit, `vlmrl plan`."""
