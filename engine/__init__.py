"""The engine: environments, rollouts, generation and policy backends, rescoring, trainer, CLI."""
