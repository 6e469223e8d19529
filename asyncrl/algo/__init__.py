"""Pure-torch RL algorithms: advantages, rollout importance sampling, losses, KL."""
