"""No module of nsa, bench or tests asks CUDA or Triton's driver anything at import: importing
must work, and stay quick, on a machine without a GPU (collection included), and a device is
asked about when a call needs it (nsa.profiles caches the answer per device).

One subprocess imports every module with the probes replaced: a call from this repository's
code raises and is reported with its line; torch's and triton's own calls pass through."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import importlib, json, pkgutil, sys, traceback
    repo = sys.argv[1]
    import torch
    import triton.runtime

    probes, failures = [], {}

    def trap(owner, name):
        real = getattr(owner, name)

        def probe(*args, **kwargs):
            caller = sys._getframe(1)
            where = caller.f_code.co_filename
            if where.startswith(repo):
                probes.append(f"{name} from {where[len(repo) + 1:]}:{caller.f_lineno}")
                raise RuntimeError(f"import-time probe {name}")
            return real(*args, **kwargs)
        return probe

    for name in ("is_available", "get_device_capability", "current_device", "device_count",
                 "get_device_name", "get_device_properties", "is_bf16_supported", "init", "_lazy_init"):
        setattr(torch.cuda, name, trap(torch.cuda, name))
    driver = type(triton.runtime.driver)
    for name in ("active", "default"):
        getter = getattr(driver, name).fget
        setattr(driver, name, property(trap(type("T", (), {name: staticmethod(getter)}), name)))

    names = []
    for package in ("nsa", "bench", "tests"):
        module = importlib.import_module(package)
        names += [m.name for m in pkgutil.walk_packages(module.__path__, package + ".")]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:
            failures[name] = traceback.format_exc(limit=-3)
    print(json.dumps({"modules": len(names), "probes": probes, "failures": failures}))
''')


def test_importing_every_module_probes_no_device():
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(REPO)], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["modules"] > 100
    assert report["probes"] == [], "modules ask CUDA or Triton at import; make it a call-time, cached function"
    assert report["failures"] == {}
