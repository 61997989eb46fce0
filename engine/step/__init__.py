"""One training step (ALGORITHM.md §4): the recipe (rollout, old log-probs, teacher pass, estimator, update),
what a step is handed (``Components``), the turn batch, Mechanism 1's engine side, rescoring, the PPO update,
whole-batch statistics, region diagnostics."""
