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


def test_only_benchmarks_import_the_testing_module(tmp_path, capsys):
    files = {
        "alignopsd/__init__.py": "",
        "alignopsd/testing.py": "from alignopsd.a import f\n",
        "alignopsd/a.py": "def f():\n    return 1\n",
        "alignopsd/b.py": "def g():\n    from alignopsd import testing\n    return testing\n",  # lazily, too
        "engine/__init__.py": "",
        "engine/c.py": "import alignopsd.testing\n",
        "bench/__init__.py": "",
        "bench/d.py": "from alignopsd.testing import f\n",
    }
    assert sc.main(["--root", str(_repo(tmp_path, files))]) == 1
    out = capsys.readouterr().out
    assert "alignopsd/b.py: imports alignopsd.testing" in out and "engine/c.py: imports alignopsd.testing" in out
    assert "bench/" not in out and "2 finding(s)" in out


def test_the_project_passes():
    """The limits hold for the project itself (what ``make lint`` runs)."""
    assert sc.main(["--root", str(ROOT)]) == 0


def _engine_tree(tmp_path: Path, modules: dict[str, str]) -> Path:
    files = {"engine/__init__.py": ""}
    for name, text in modules.items():
        folder = name.split("/")[0]
        files.setdefault(f"engine/{folder}/__init__.py", "")
        files[f"engine/{name}"] = text
    return _repo(tmp_path, files)


def test_imports_point_down_the_engine_layers(tmp_path, capsys):
    """Down and within a layer pass; up (at module level, inside a function, under TYPE_CHECKING) is refused, and so
    is a subpackage that no layer holds."""
    root = _engine_tree(
        tmp_path,
        {
            "infra/cache.py": "",
            "observe/profiler.py": "from alignopsd.engine.infra import cache\n",
            "policy/lm_head.py": "from alignopsd.engine.generation import base\n",  # a peer of the same layer
            "generation/base.py": "from ..observe.profiler import x\n",  # relative, down
            "step/batch.py": "from alignopsd.engine.run.components import Components\n",
            "step/rollout.py": "def f():\n    import alignopsd.engine.commands.cli\n",
            "step/recipe.py": (
                "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from alignopsd.engine.run import trainer\n"
            ),
            "run/components.py": "from alignopsd.engine.step import rollout\n",
            "run/trainer.py": "",
            "commands/cli.py": "",
            "shelf/x.py": "",
        },
    )
    assert sc.main(["--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert "engine/step/batch.py:1 imports alignopsd.engine.run.components: engine/run/ is above engine/step/" in out
    assert "engine/step/rollout.py:2 imports alignopsd.engine.commands.cli: engine/commands/ is above" in out
    assert "engine/step/recipe.py:4 imports alignopsd.engine.run.trainer: engine/run/ is above" in out
    assert "engine/shelf/x.py: engine/shelf/ is in no layer" in out
    assert "engine/policy" not in out and "engine/generation" not in out and "engine/observe" not in out
    assert "engine/shelf/__init__.py: engine/shelf/ is in no layer" in out
    assert "5 finding(s)" in out


def test_one_upward_import_in_the_real_tree_is_refused(tmp_path, capsys):
    """A copy of the project's own tracked files with one upward import added (the one the step's token layout
    used to cause: the policy's LM head reading the step's batch module) fails the check, naming it."""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = {p: (ROOT / p).read_text() for p in tracked.stdout.split() if p.split("/")[0] in sc.PACKAGES}
    head = files["engine/policy/lm_head.py"]
    files["engine/policy/lm_head.py"] = head.replace(
        "from __future__ import annotations\n",
        "from __future__ import annotations\n\nimport alignopsd.engine.step.batch\n",
        1,
    )
    assert files["engine/policy/lm_head.py"] != head
    root = _repo(tmp_path, files)
    for built in ROOT.glob("alignopsd/_C*"):  # the compiled extension, as in the checkout
        (root / "alignopsd" / built.name).symlink_to(built)
    assert sc.main(["--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert "engine/policy/lm_head.py" in out and "imports alignopsd.engine.step.batch: engine/step/ is above" in out
    assert "1 finding(s)" in out


def test_the_design_writes_the_layer_order_the_check_keeps():
    """docs/DESIGN.md's layer block (top first) names the same subpackages per row as ENGINE_LAYERS (bottom first)."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    block = text.split("<!-- layers -->", 1)[1].split("<!-- /layers -->", 1)[0]
    rows = [line.split("  ") for line in block.splitlines() if line.strip() and not line.strip().startswith("```")]
    written = [tuple(sorted(w.strip().rstrip("/") for w in row if w.strip().endswith("/"))) for row in rows]
    assert written[::-1] == [tuple(sorted(row)) for row in sc.ENGINE_LAYERS]


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
