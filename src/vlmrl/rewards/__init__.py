"""Reward functions: the built-in ones, loading a user's, and scoring a rollout the way TRL calls rewards."""
