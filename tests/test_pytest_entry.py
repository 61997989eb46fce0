"""``pytest`` and ``python -m pytest`` see the same packages.

The console script starts with its own folder on ``sys.path``, ``python -m pytest`` with the working directory; the
suite's conftest puts tests/ there too, where tests/alignopsd/ and tests/bench/ (folders without ``__init__.py``)
would be found as namespace packages ``alignopsd`` and ``bench`` unless the repository root is on the path as well
(pyproject.toml's ``pythonpath``). A namespace ``alignopsd`` still imports its submodules through the editable
install, so most tests pass and only the package's own names (``from alignopsd import action_filter``) fail.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("alignopsd", "bench")  # imported by top-level name, each with a folder of the same name under tests/


def test_the_packages_are_the_packages_not_test_folders():
    for name in PACKAGES:
        mod = importlib.import_module(name)
        assert mod.__file__ is not None, f"{name} is a namespace package over {list(mod.__path__)}"
        assert not Path(mod.__file__).resolve().is_relative_to(ROOT / "tests"), mod.__file__
    from alignopsd import __version__  # a name of the package's own __init__

    assert __version__


def test_the_console_script_runs_the_check_alike(tmp_path):
    """The check above, run with the console script's path layout (a script outside the repository, as
    ``.venv/bin/pytest`` is) from the repository root; the suite itself runs it as ``python -m pytest`` does."""
    script = tmp_path / "pytest_console.py"
    script.write_text("import sys\n\nimport pytest\n\nsys.exit(pytest.main())\n")
    node = f"{Path(__file__).relative_to(ROOT)}::test_the_packages_are_the_packages_not_test_folders"
    cmd = [sys.executable, str(script), "-q", "-p", "no:randomly", node]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]
