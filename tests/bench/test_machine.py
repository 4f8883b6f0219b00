from __future__ import annotations

import subprocess
import sys

from bench import machine
from nsa_contract import results


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def test_git_sha_unknown_outside_a_repo(tmp_path, monkeypatch):
    monkeypatch.delenv("NSA_GIT_SHA", raising=False)
    monkeypatch.delenv("GITHUB_SHA", raising=False)
    assert machine.git_sha(tmp_path) == "unknown"


def test_explicit_sha_wins_over_a_stale_git_dir(tmp_path, monkeypatch):
    """A tree copied to a GPU box may carry an old .git; the SHA the caller exported is the truth."""
    _git(tmp_path, "init", "-q")
    (tmp_path / "f.txt").write_text("a")
    _git(tmp_path, "add", "f.txt")
    _git(tmp_path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x")
    monkeypatch.setenv("NSA_GIT_SHA", "abc1234")
    assert machine.git_sha(tmp_path) == "abc1234"
    monkeypatch.delenv("NSA_GIT_SHA")
    assert machine.git_sha(tmp_path) not in ("abc1234", "unknown")


def test_git_sha_and_dirty(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "f.txt").write_text("a")
    _git(tmp_path, "add", "f.txt")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    sha = machine.git_sha(tmp_path)
    assert len(sha) == 40
    (tmp_path / "f.txt").write_text("b")
    assert machine.git_sha(tmp_path) == f"{sha}-dirty"


def test_a_broken_package_counts_as_absent_with_the_reason(tmp_path, monkeypatch):
    (tmp_path / "broken_fa.py").write_text("raise OSError('libcudart.so.12: cannot open shared object')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    version, reason = machine.package_version("broken_fa")
    assert version is None and "OSError" in reason and "libcudart" in reason
    assert machine.package_version("json")[1] is None
    sys.modules.pop("broken_fa", None)


def test_cpu_machine_record_has_every_schema_field():
    info = machine.machine_info("cpu")
    assert set(results.MACHINE_FIELDS) <= set(info)
    assert info["sm"] == "cpu" and info["torch"]


def test_nvml_absent_is_reported_not_raised(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    snap = machine.nvml_snapshot()
    assert snap["available"] is False and "reason" in snap


def test_nvml_snapshot_reads_clocks_through_a_fake_nvml(monkeypatch):
    import types

    calls = []
    fake = types.SimpleNamespace(
        NVML_CLOCK_SM=0, NVML_CLOCK_MEM=1, NVML_TEMPERATURE_GPU=0,
        nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByUUID=lambda uuid: "h", nvmlDeviceGetHandleByIndex=lambda i: "h",
        nvmlDeviceGetClockInfo=lambda h, kind: (1980, 2619)[kind],
        nvmlDeviceGetMaxClockInfo=lambda h, kind: (1980, 2619)[kind],
        nvmlDeviceGetTemperature=lambda h, kind: 41, nvmlDeviceGetPowerUsage=lambda h: 123456,
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700000,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0x4 | 0x40 | 0x10000)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    snap = machine.nvml_snapshot()
    assert snap["available"] and snap["sm_clock_mhz"] == 1980 and snap["max_mem_clock_mhz"] == 2619
    assert snap["power_w"] == 123.456 and snap["temperature_c"] == 41
    assert snap["throttle_reasons"] == ["sw_power_cap", "hw_thermal_slowdown", "0x10000"]
    assert calls == ["init", "shutdown"]


def test_a_namespace_flash_attn_is_not_fa2(tmp_path, monkeypatch):
    """flash-attn-4 installs `flash_attn/cute` without `flash_attn/__init__.py`: `import flash_attn`
    then succeeds as a namespace package. The machine record and the FA-2 adapter must not take
    that for FA-2; the fa3/fa4 entries read the installed distributions."""
    from nsa.backends import flash_attn as fa2_adapter

    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    try:
        version, reason = machine.package_version("flash_attn")
        assert version is None and "namespace package" in reason and "flash_attn.cute" in reason
        assert "namespace package" in fa2_adapter.unavailable_reason()
        info = machine.machine_info("cpu")
        assert info["flash_attn"] is None and "fa3" in info and "fa4" in info
    finally:
        sys.modules.pop("flash_attn", None)
    assert machine.dist_version("pytest")[0] and machine.dist_version("no-such-dist-xyz") == (
        None, "no-such-dist-xyz is not installed")
