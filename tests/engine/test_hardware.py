"""dtype ``auto`` by the hardware, from injected CPU flags (never the test machine's own), and the refusal of a
dtype the device cannot compute when the config loads."""

from __future__ import annotations

import pytest
import torch
from alignopsd.engine.config.schema import ConfigError, load_config
from alignopsd.engine.models.loading import parse_dtype
from alignopsd.engine.parallel import hardware as hw

EPYC_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx avx2 fma f16c\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n\nprocessor\t: 1\nflags\t\t: fpu\n"
SAPPHIRE = "flags\t\t: avx512f avx512_fp16 amx_bf16 amx_tile\n"
GRAVITON3 = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd fphp asimdhp bf16 i8mm sve\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd evtstrm fphp asimdhp\n"


def test_flags_of_the_first_processor():
    assert hw.parse_cpu_flags(ZEN4) == {"fpu", "avx2", "avx512f", "avx512_bf16", "avx512_vnni"}
    assert "bf16" in hw.parse_cpu_flags(GRAVITON3)
    assert hw.parse_cpu_flags("processor: 0\nmodel name: x\n") == frozenset()


@pytest.mark.parametrize(
    "cpuinfo, dtype, reason",
    [
        (EPYC_AVX2, torch.float32, "CPU without avx512_bf16/amx_bf16 or Arm bf16"),
        (ZEN4, torch.bfloat16, "CPU with avx512_bf16"),
        (SAPPHIRE, torch.bfloat16, "CPU with amx_bf16"),
        (GRAVITON3, torch.bfloat16, "CPU with bf16"),
        (GRAVITON2, torch.float32, "CPU without avx512_bf16/amx_bf16 or Arm bf16"),
    ],
)
def test_auto_on_the_cpu_follows_its_flags(cpuinfo, dtype, reason):
    choice = hw.choose_dtype("auto", "cpu", flags=hw.parse_cpu_flags(cpuinfo))
    assert choice.dtype is dtype and choice.reason == reason
    assert choice.line() == f"model.dtype auto -> {str(dtype)[6:]} ({reason})"


def test_auto_on_cuda_follows_native_bf16():
    assert hw.choose_dtype("auto", "cuda", cuda_bf16=True).dtype is torch.bfloat16
    none = hw.choose_dtype("auto", "cuda", cuda_bf16=False)
    assert none.dtype is torch.float32 and none.reason == "CUDA without native bf16"


def test_explicit_dtype_wins():
    flags = hw.parse_cpu_flags(ZEN4)
    assert hw.choose_dtype("float32", "cpu", flags=flags).dtype is torch.float32
    slow = hw.choose_dtype("bfloat16", "cpu", flags=hw.parse_cpu_flags(EPYC_AVX2))
    assert slow.dtype is torch.bfloat16 and "no native bf16" in slow.reason
    assert hw.choose_dtype("bf16", "cpu", flags=flags).reason == "explicit"
    with pytest.raises(ValueError, match="int3"):
        hw.choose_dtype("int3", "cpu")


def test_the_reader_takes_the_environment_override(monkeypatch, tmp_path):
    fake = tmp_path / "cpuinfo"
    fake.write_text(ZEN4)
    monkeypatch.setattr(hw, "CPUINFO", fake)
    monkeypatch.delenv(hw.CPU_FLAGS_ENV, raising=False)
    assert "avx512_bf16" in hw.cpu_flags() and parse_dtype("auto", "cpu") is torch.bfloat16
    monkeypatch.setenv(hw.CPU_FLAGS_ENV, "avx2 fma")
    assert hw.cpu_flags() == {"avx2", "fma"} and parse_dtype("auto", "cpu") is torch.float32
    monkeypatch.delenv(hw.CPU_FLAGS_ENV)
    monkeypatch.setattr(hw, "CPUINFO", tmp_path / "missing")
    assert hw.cpu_flags() == frozenset() and parse_dtype(None, "cpu") is torch.float32


@pytest.mark.parametrize("cpuinfo", [SAPPHIRE, GRAVITON2])
def test_float16_runs_on_cpus_with_native_half_precision(cpuinfo):
    hw.check_runs(torch.float16, "cpu", flags=hw.parse_cpu_flags(cpuinfo))


def test_device_refusals():
    with pytest.raises(ValueError, match="avx512_fp16 or amx_fp16"):
        hw.check_runs(torch.float16, "cpu", flags=hw.parse_cpu_flags(ZEN4))
    with pytest.raises(ValueError, match="native bf16"):
        hw.check_runs(torch.bfloat16, "cuda", cuda_bf16=False)
    hw.check_runs(torch.bfloat16, "cuda", cuda_bf16=True)
    hw.check_runs(torch.bfloat16, "cpu", flags=frozenset())  # emulated on the CPU: slow, but it runs


def test_config_refuses_float16_on_a_cpu_without_it(monkeypatch):
    monkeypatch.setenv(hw.CPU_FLAGS_ENV, "avx2 avx512_bf16")
    with pytest.raises(ConfigError, match=r"model.dtype: 'float16' on this machine's CPU: float16 needs"):
        load_config(None, ["model.dtype=float16", "trainer.device=cpu"])
    monkeypatch.setenv(hw.CPU_FLAGS_ENV, "avx512_fp16")
    assert load_config(None, ["model.dtype=float16", "trainer.device=cpu"]).model.dtype == "float16"


def test_config_refuses_bf16_on_a_gpu_without_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hw, "cuda_native_bf16", lambda: False)
    with pytest.raises(ConfigError, match=r"model.dtype: 'bfloat16' on this machine's CUDA: bfloat16 needs a GPU"):
        load_config(None, ["model.dtype=bfloat16"])  # trainer.device auto: CUDA here


def test_cli_exits_2_and_first_line_says_the_choice(monkeypatch, capsys):
    from alignopsd.engine.commands import cli
    from test_cli import TINY

    monkeypatch.setenv(hw.CPU_FLAGS_ENV, "avx2")
    assert cli.main(["train", "--config", TINY, "--set", "model.dtype=float16", "--set", "trainer.device=cpu"]) == 2
    assert "float16 needs a CPU with native half-precision" in capsys.readouterr().err
    cfg = load_config(TINY, ["trainer.device=cpu"])
    assert cfg.dtype_line().startswith("[dtype] model.dtype auto -> float32 (CPU without avx512_bf16/amx_bf16")
    monkeypatch.setenv(hw.CPU_FLAGS_ENV, "avx512_bf16")
    assert "auto -> bfloat16 (CPU with avx512_bf16)" in cfg.dtype_line()
