"""The `machine` record of a results file: device, versions, clocks; and the git sha of the tree.

Everything is queried when called, never at import. Every probe that can fail (no NVML, a
broken flash-attn install, no git) records null or "unknown" with the reason, never raises.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent

# nvmlClocksEventReasons bits (nvml.h); names as in `nvidia-smi -q`.
_THROTTLE_BITS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
    0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}


def git_sha(root: str | os.PathLike[str] = REPO_ROOT) -> str:
    """`git rev-parse HEAD`, plus `-dirty` when tracked files differ; "unknown" outside a repo
    (or before the first commit). An explicit `NSA_GIT_SHA` wins: a tree copied to a GPU box may
    carry a stale `.git` (seen on the lent H100: it reported the session's first commit)."""
    if os.environ.get("NSA_GIT_SHA"):
        return os.environ["NSA_GIT_SHA"]

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=30, check=False)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            # A copied tree without .git (e.g. shipped to a GPU box).
            return os.environ.get("GITHUB_SHA") or "unknown"
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    sha = head.stdout.strip()
    return f"{sha}-dirty" if status.returncode == 0 and status.stdout.strip() else sha


def package_version(module: str) -> tuple[str | None, str | None]:
    """(version, None) when `module` imports, else (None, why). Any exception counts as absent:
    a broken flash-attn build raises ImportError, OSError or RuntimeError on import."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - a broken install may raise anything
        return None, f"{type(exc).__name__}: {exc}".strip()[:300]
    if namespace_package(mod):
        # flash-attn-4 installs `flash_attn/cute` alone, which makes `import flash_attn` succeed
        # without FA-2.
        return None, f"{module} is only a namespace package here ({', '.join(sorted(_subpackages(mod))) or 'empty'})"
    version = getattr(mod, "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version(module.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
    return str(version), None


def namespace_package(mod: Any) -> bool:
    """A directory without `__init__.py` imported as a package (no origin, a search path)."""
    spec = getattr(mod, "__spec__", None)
    return spec is not None and spec.origin is None and spec.submodule_search_locations is not None


def _subpackages(mod: Any) -> list[str]:
    import pkgutil

    return [f"{mod.__name__}.{m.name}" for m in pkgutil.iter_modules(getattr(mod, "__path__", []))]


def dist_version(dist: str) -> tuple[str | None, str | None]:
    """(version, None) of an installed distribution, without importing it; (None, why) if absent."""
    try:
        return importlib.metadata.version(dist), None
    except importlib.metadata.PackageNotFoundError:
        return None, f"{dist} is not installed"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvml_handle(pynvml: Any, torch: Any) -> Any:
    # NVML ignores CUDA_VISIBLE_DEVICES; find the GPU torch calls device 0 by its UUID.
    try:
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:  # noqa: BLE001 - older torch has no uuid; fall back to the visible index
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        return pynvml.nvmlDeviceGetHandleByIndex(int(first) if first.isdigit() else 0)


def nvml_snapshot() -> dict[str, Any]:
    """Clocks (MHz), max clocks, temperature (C), power (W) and throttle reasons of the current
    GPU through NVML (nvidia-ml-py). `{"available": False, "reason": ...}` when NVML is absent."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - missing package, missing driver library, ...
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"[:300]}
    out: dict[str, Any] = {"available": True}
    try:
        handle = _nvml_handle(pynvml, torch)
        probes = {
            "sm_clock_mhz": lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
            "mem_clock_mhz": lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM),
            "max_sm_clock_mhz": lambda: pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM),
            "max_mem_clock_mhz": lambda: pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM),
            "temperature_c": lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
            "power_w": lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            "power_limit_w": lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0,
            "throttle_reasons": lambda: _throttle_names(pynvml, handle),
        }
        for key, probe in probes.items():
            try:
                out[key] = probe()
            except Exception:  # noqa: BLE001 - some fields are unsupported on some boards
                out[key] = None
    except Exception as exc:  # noqa: BLE001
        out = {"available": False, "reason": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    return out


def _throttle_names(pynvml: Any, handle: Any) -> list[str]:
    get = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
    mask = int(get(handle))
    names = [name for bit, name in _THROTTLE_BITS.items() if mask & bit]
    rest = mask & ~sum(_THROTTLE_BITS)
    return names + ([f"0x{rest:x}"] if rest else [])


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - fall back to nvidia-smi
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def machine_info(device: str) -> dict[str, Any]:
    """The `machine` record for a run on `device` (`"cpu"` or `"cuda"`, the current GPU)."""
    import torch

    triton, _ = package_version("triton")
    flash_attn, flash_attn_reason = package_version("flash_attn")
    info: dict[str, Any] = {
        "gpu_name": "cpu", "sm": "cpu", "driver": None, "cuda": torch.version.cuda,
        "torch": torch.__version__, "triton": triton, "flash_attn": flash_attn,
        "flash_attn_reason": flash_attn_reason, "fa3": dist_version("fa3-fwd")[0],
        "fa4": dist_version("flash-attn-4")[0], "python": platform.python_version(),
        "cpu_name": _cpu_name(), "hostname": platform.node(), "cudnn": None,
    }
    if device == "cuda":
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        props = torch.cuda.get_device_properties(index)
        info.update({
            "gpu_name": torch.cuda.get_device_name(index), "sm": f"sm{major}{minor}",
            "driver": _driver_version(), "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "gpu_count": torch.cuda.device_count(),
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "nvml": nvml_snapshot(),
        })
    return info
