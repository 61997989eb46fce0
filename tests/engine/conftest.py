"""Fixtures shared by the engine's tests."""

from __future__ import annotations

import faulty_env as faulty_module
import pytest


@pytest.fixture
def faulty_env():
    """The codeword game with injected faults (faulty_env.py), registered as ``codeword_faulty``; the module."""
    faulty_module.register()
    return faulty_module
