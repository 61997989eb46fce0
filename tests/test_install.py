"""The distribution as a user installs it: a wheel built from the repository root, installed into a fresh virtual
environment that does not see the repository, used from an unrelated folder.

An editable install maps whole folders and so hides a package that the wheel leaves out; this test does not. The
project's dependencies come from the test's own environment (a ``.pth`` line naming its site-packages, whose own
``.pth`` files, the editable install's among them, are not read from there), so nothing is downloaded.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOTS = {"alignopsd": "alignopsd", "alignopsd.kernels": "kernels", "alignopsd.engine": "engine"}

pytestmark = pytest.mark.slow


def _source_modules() -> set[str]:
    """Every module of the source tree under its import name (the design card's folder -> name mapping)."""
    out = set()
    for name, folder in ROOTS.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            if "__pycache__" in rel:
                continue
            parts = rel[:-1] if rel[-1] == "__init__" else rel
            out.add(".".join([name, *parts]))
    return out


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel, venv python, venv bin, a folder outside the repository, environment) of the installed wheel."""
    tmp = tmp_path_factory.mktemp("install")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # built from the repository root, as a user runs it; the build tools come from this environment. One build at a
    # time: each pytest-xdist worker that runs a test of this module builds, and two builds in the root's build/ at
    # once collide (setuptools' bdist folder: "File exists")
    with open(tmp_path_factory.getbasetemp().parent / "alignopsd-wheel-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                ".",
                "--no-deps",
                "--no-build-isolation",
                "-q",
                "-w",
                str(tmp / "dist"),
            ],
            cwd=ROOT,
            env=env,
            timeout=900,
        )
    (wheel,) = (tmp / "dist").glob("alignopsd-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp, env=env)
    py = venv / "bin" / "python"
    site = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp, env).stdout.strip()
    # the dependencies of this environment, not its editable alignopsd (a path line reads no .pth files there)
    Path(site, "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)], tmp, env)
    work = tmp / "elsewhere"
    work.mkdir()
    return wheel, py, venv / "bin", work, env


def test_wheel_holds_every_module_of_the_tree(installed):
    """Every .py file of alignopsd/, kernels/ and engine/ is in the wheel under its import name, with the C++
    extension and the environments' skill banks."""
    wheel = installed[0]
    names = zipfile.ZipFile(wheel).namelist()
    got = set()
    for n in names:
        if n.endswith(".py"):
            parts = Path(n).with_suffix("").parts
            got.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    missing = sorted(_source_modules() - got)
    assert not missing, f"modules missing from the wheel: {missing}"
    assert any(n.startswith("alignopsd/_C") and n.endswith(".so") for n in names), "no C++ extension in the wheel"
    for family in ("alfworld", "webshop", "search", "credit"):
        assert f"alignopsd/engine/envs/{family}/skills/skill_mapping.json" in names, family


def test_installed_package_imports_every_module(installed):
    """From a folder outside the repository, the installed package (not the source tree) imports every module."""
    _, py, _, work, env = installed
    code = (
        "import importlib, sys\n"
        "import alignopsd\n"
        f"assert {str(ROOT)!r} not in alignopsd.__file__, alignopsd.__file__\n"
        "names = sys.stdin.read().split()\n"
        "for n in names: importlib.import_module(n)\n"
        "print(len(names))\n"
    )
    mods = sorted(m for m in _source_modules() if not m.endswith(".__main__"))  # a __main__ runs a command
    r = subprocess.run(
        [str(py), "-c", code], input="\n".join(mods), cwd=work, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert int(r.stdout.strip().splitlines()[-1]) == len(mods)


def test_installed_console_trains_and_evaluates(installed, tmp_path):
    """``alignopsd --help``, one step of ``alignopsd train`` on the tiny config and ``alignopsd eval`` of its
    checkpoint, all through the installed console script from a folder outside the repository."""
    _, _, bin_dir, work, env = installed
    cli = str(bin_dir / "alignopsd")
    r = _run([cli, "--help"], work, env)
    assert "alignopsd train" in r.stdout
    out = tmp_path / "run"
    sets = [
        "trainer.total_steps=1",
        "env.tasks_per_step=1",
        "env.group_n=2",
        "env.max_turns=2",
        "env.val_tasks=2",
        "generation.backend=choice",
        "algorithm.estimator=grpo",
        "algorithm.kl_coef=0.0",
        f"output_dir={out}",
    ]
    argv = ["--config", str(ROOT / "configs" / "tiny.yaml")] + [a for s in sets for a in ("--set", s)]
    r = _run([cli, "train", *argv], work, env)
    ckpt = out / "checkpoints" / "step_000001"
    assert (ckpt / "trainer_state.json").is_file(), r.stdout[-2000:]
    assert (out / "metrics.jsonl").read_text().count("\n") >= 1
    r = _run([cli, "eval", *argv, "--checkpoint", str(ckpt)], work, env)
    assert "success" in r.stdout.lower(), r.stdout[-2000:]
