"""The credit environment family: its environment, task source and data (see engine/envs/registry.py)."""
