"""The allocator a process starts with: the environment that gives it, what the process reports, the CLI's restart."""

from __future__ import annotations

import subprocess
import sys

import pytest
from alignopsd.engine.infra import allocator as alloc

PROBE = "from alignopsd.engine.infra.allocator import active_allocator; print(active_allocator())"


def _active_in(env: dict[str, str]) -> str:
    return subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_env_sets_one_choice_and_clears_the_others():
    base = {
        "LD_PRELOAD": "/x/libmimalloc.so:/y/libother.so",
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.rtld.x=1",
    }
    env = alloc.allocator_env("default", base)
    assert env["LD_PRELOAD"] == "/y/libother.so"  # another library's preload is kept
    assert env["GLIBC_TUNABLES"] == "glibc.rtld.x=1"  # malloc tunables of an earlier choice go
    glibc = alloc.allocator_env("glibc", base)
    assert glibc["GLIBC_TUNABLES"] == f"glibc.rtld.x=1:{alloc.GLIBC_TUNABLES}"
    assert glibc[alloc.CHOICE_VAR] == "glibc"
    with pytest.raises(ValueError, match="unknown 'jemalloc'"):
        alloc.allocator_env("jemalloc", base)
    with pytest.raises(ValueError, match="ALIGNOPSD_ALLOCATOR='tc'"):
        alloc.wanted_allocator({alloc.CHOICE_VAR: "tc"})


@pytest.mark.parametrize("name", alloc.ALLOCATORS)
def test_a_process_started_with_a_choice_has_it(name):
    if name not in alloc.available():
        pytest.skip(f"{name} is not installed here")
    assert _active_in(alloc.allocator_env(name)) == name


def test_the_command_line_restarts_under_the_wanted_allocator():
    """`alignopsd` run from a shell: a process without the wanted allocator starts again with it (same pid), and
    one whose restart could not load it goes on and says so instead of restarting forever."""
    env = alloc.allocator_env("default")
    env[alloc.CHOICE_VAR] = "glibc"
    code = (
        "import os, sys; from alignopsd.engine.infra.allocator import restart_under, allocator_line; "
        "print(os.getpid(), allocator_line(), flush=True); "
        "restart_under(sys.argv[1:], 'alignopsd.engine')"
    )
    out = subprocess.run([sys.executable, "-c", code, "--help"], env=env, capture_output=True, text=True, check=True)
    first, *rest = out.stdout.splitlines()
    assert first.split()[1:] == ["allocator", "default"]
    assert "alignopsd" in "\n".join(rest)  # the command itself ran after the restart (its help text)
    env[alloc.APPLIED_VAR] = "mimalloc"  # a restart already tried and did not get it
    env[alloc.CHOICE_VAR] = "mimalloc"
    if "mimalloc" in alloc.available():
        env["LD_PRELOAD"] = ""
        line = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        assert "mimalloc was asked for and could not be loaded" in line
