"""Suite-wide settings and shared test support.

- This folder is on ``sys.path`` (pytest's default import mode inserts a conftest's folder), so
  ``selection_oracle`` -- the one test oracle of the source selection -- imports from any area.
- Strict mode (engine/strict.py): a diagnostic that would swallow an exception to keep a run alive raises it in
  every test instead of counting it.
"""

from __future__ import annotations

import os

from alignopsd.engine.strict import STRICT_ENV

os.environ[STRICT_ENV] = "1"  # before any test imports the engine's runs, and inherited by torchrun children
