"""Kernel tests run the Triton kernels on CPU through the Triton interpreter.

``alignopsd.kernels`` decorates its kernels lazily at launch (see ``kernels/_dispatch.py``),
so setting ``TRITON_INTERPRET=1`` per test is enough, whichever module imported triton first
in this process. The variable is restored after each test, so other test areas are unaffected.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
