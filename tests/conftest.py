"""Suite-wide settings: strict mode (engine/strict.py), so a diagnostic that would swallow an exception to keep a
run alive raises it in every test instead of counting it."""

from __future__ import annotations

import os

from alignopsd.engine.strict import STRICT_ENV

os.environ[STRICT_ENV] = "1"  # before any test imports the engine's runs, and inherited by torchrun children
