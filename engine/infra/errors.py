"""The error a wrong setting raises, below every layer that checks one.

The config's schema (engine/config/), an environment's official-data check (engine/envs/<family>/official.py) and
the backends all refuse a bad setting with :class:`ConfigError`; the CLI prints its one line and exits with code 2.
engine/config/errors.py re-exports it beside the schema's message helpers.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration key or value is invalid (the message names the dotted key)."""


README_HINT = 'see README.md, "Running the paper\'s experiments"'
"""Where the paper's setup (official data, models) is explained; named by the pre-flight messages."""
