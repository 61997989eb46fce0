"""The project's structure check (``make lint``) finds each kind of violation in a small synthetic checkout."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("structure_check", ROOT / "tools" / "structure_check.py")
sc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sc)


def _repo(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "."], cwd=tmp_path, check=True)
    return tmp_path


def test_clean_tree_passes(tmp_path, capsys):
    root = _repo(tmp_path, {"alignopsd/__init__.py": "", "alignopsd/a.py": "def f():\n    return 1\n"})
    assert sc.main(["--root", str(root)]) == 0
    assert "0 finding(s)" in capsys.readouterr().out


def test_each_violation_is_found(tmp_path, capsys):
    long_body = "".join(f"    x{i} = {i}\n" for i in range(12))
    kernel = "import triton\n\n\n@triton.jit\ndef k():\n" + long_body
    root = _repo(
        tmp_path,
        {
            "alignopsd/__init__.py": "",
            "alignopsd/a.py": "from alignopsd.b import _helper\n\n\ndef big():\n" + long_body,
            "alignopsd/b.py": "def _helper():\n    from alignopsd import a\n    return a\n",
            "kernels/__init__.py": "",
            "kernels/k.py": kernel,
            "engine/__init__.py": "",
            "engine/long.py": "\n" * 30,
            "tests/test_x.py": "def test():\n" + long_body,
        },
    )
    assert sc.main(["--root", str(root), "--max-func", "10", "--max-file", "20"]) == 1
    out = capsys.readouterr().out
    assert "alignopsd/a.py:4 big: 13 lines" in out
    assert "imports the private name _helper from alignopsd.b" in out
    assert "import cycle: alignopsd.a <-> alignopsd.b" in out
    assert "engine/long.py: 30 lines" in out
    assert "kernels/k.py" not in out and "tests/" not in out  # Triton kernels and tests are exempt
    assert "4 finding(s)" in out


def test_the_project_passes():
    """The limits hold for the project itself (what ``make lint`` runs)."""
    assert sc.main(["--root", str(ROOT)]) == 0


def test_probing_a_contracted_object_in_the_engine_is_found(tmp_path, capsys):
    probing = (
        "def f(parts, generator, est_out, cfg):\n"
        "    a = getattr(parts.generator, 'sleep', None)\n"
        "    b = hasattr(generator, 'model')\n"
        "    c = isinstance(parts.policy, object)\n"
        "    d = getattr(est_out, 'credit', None)\n"
        "    e = getattr(cfg, 'seed', 0)\n"  # not a contracted object: allowed
        "    return a, b, c, d, e\n"
    )
    root = _repo(
        tmp_path,
        {
            "engine/__init__.py": "",
            "engine/step.py": probing,
            "alignopsd/__init__.py": "",
            "alignopsd/core.py": "def g(policy):\n    return getattr(policy, 'x', None)\n",  # outside engine/
        },
    )
    assert sc.main(["--root", str(root)]) == 1
    out = capsys.readouterr().out
    found = [line for line in out.splitlines() if "probes a contracted object" in line]
    assert [line.split(" ")[0] for line in found] == [f"engine/step.py:{n}" for n in (2, 3, 4, 5)], out
    assert "4 finding(s)" in out


def test_the_engine_probes_no_contracted_object():
    # the checkout itself: every member read from a backend, an environment or an estimator output is declared
    files = [p for p in sc.tracked_files(ROOT) if p.parts[0] == "engine"]
    found = [(str(p), line) for p in files for line, _ in sc.probes(sc.ast.parse((ROOT / p).read_text()))]
    assert files and found == []
