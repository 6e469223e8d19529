"""Learners: recompute logprobs, correct with rollout IS, optimise the policy loss."""
