"""Access to the compiled C++ paths (``alignopsd._C``) and the ``impl`` switch of segmentation and projection.

``impl="auto"`` uses the C++ extension when it was built and the Python path otherwise (the kernels' one routing
rule, ``alignopsd.kernels.resolve_impl``); the first time the extension is found missing, one warning says so
(``warnings`` + ``logging``). ``impl="cpp"`` without the extension raises ``ValueError``; ``impl="python"`` always
works.
Both paths give bit-identical results (tests/alignopsd/test_native.py).
"""

from __future__ import annotations

import logging
import warnings
from types import ModuleType

from alignopsd.kernels import NativePath
from alignopsd.kernels import resolve_impl as route

__all__ = ["IMPLS", "native", "resolve_impl"]

IMPLS = ("auto", "python", "cpp")

_log = logging.getLogger("alignopsd")
_warned = False

try:  # pragma: no cover - depends on the build
    from alignopsd import _C as _ext  # type: ignore[attr-defined]

    _import_error: str | None = None
except ImportError as exc:  # pragma: no cover - depends on the build
    _ext = None
    _import_error = str(exc)


def native() -> ModuleType:
    """The C++ extension module (``ValueError`` if it is missing)."""
    if _ext is None:
        raise ValueError(f"impl: 'cpp' requested but {_missing()}")
    return _ext


def _missing() -> str:
    return (
        f"the C++ extension alignopsd._C is not built ({_import_error}); "
        "rebuild with `pip install -e . --no-deps --no-build-isolation` or use impl='python'"
    )


def _warn_once() -> None:
    global _warned
    if _warned:
        return
    _warned = True
    msg = (
        "alignopsd: the C++ extension alignopsd._C is not available "
        f"({_import_error}); segmentation and box projection use the slower Python path"
    )
    _log.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def resolve_impl(impl: str, name: str = "impl") -> str:
    """Map ``"auto" | "python" | "cpp"`` to ``"python"`` or ``"cpp"``: the kernels' routing rule
    (``alignopsd.kernels.resolve_impl``) with the extension as the custom CPU path, taken wherever it was built
    (bit-identical to the Python path, so nothing is measured); ``"python"`` is that rule's ``"torch"``."""
    if impl not in IMPLS:
        raise ValueError(f"{name}: unknown value {impl!r}; allowed: 'auto', 'python', 'cpp'")
    got = route("torch" if impl == "python" else impl, native=NativePath(_ext is not None, why=_missing()))
    if impl == "auto" and got == "torch":
        _warn_once()
    return "python" if got == "torch" else got
