"""Rollout: engine servers, the SGLang-protocol client, rollout actors."""
