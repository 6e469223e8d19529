"""Rollout: the workers that turn prompts into scored trajectory groups (single-turn prompts and
multi-turn environment episodes), the dispatcher that feeds them, their Ray pool, and held-out
evaluation through the same engines."""
