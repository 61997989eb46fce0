"""Strict mode: a diagnostic that catches an exception to keep a run alive re-raises it instead.

Diagnostics (token regions and the paired statistics, the audit, closing components at shutdown, decoding a token
piece for the audit) never stop a training run: a failure there is logged and counted (``regions/errors``,
``audit/errors``). That hides bugs from tests, so the test suite turns strict mode on (the environment variable
``ALIGNOPSD_STRICT=1``, set by tests/conftest.py) and every such handler calls :func:`reraise_if_strict` first.
"""

from __future__ import annotations

import os

STRICT_ENV = "ALIGNOPSD_STRICT"


def strict() -> bool:
    """Whether strict mode is on (``ALIGNOPSD_STRICT`` set to 1/true/yes/on)."""
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def reraise_if_strict(exc: BaseException) -> None:
    """Raise ``exc`` when strict mode is on; return otherwise (the caller then logs and counts it)."""
    if strict():
        raise exc
