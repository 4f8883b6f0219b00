"""The import direction of DESIGN.md, enforced: no arrow runs up.

    nsa_contract  (bottom: keys, settings, schemas; no torch)
    nsa          -> nsa_contract
    bench        -> nsa, nsa_contract
    ci           -> nsa_contract               (no torch either: ci reads files)

Every module of the four packages is read with `ast`, so lazy imports inside functions count as
much as those at the top, relative imports are resolved, and `importlib.import_module("...")`
with a literal name (or an f-string's literal head) counts too. bench/experiments/ (the lab
notebook, leaving the package) and tests/ are not part of the layers.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Package -> the packages it may import (itself included). Anything else of these four is an arrow up
# (or sideways, ci -> bench / ci -> nsa).
LAYERS: dict[str, frozenset[str]] = {
    "nsa_contract": frozenset({"nsa_contract"}),
    "nsa": frozenset({"nsa", "nsa_contract"}),
    "bench": frozenset({"bench", "nsa", "nsa_contract"}),
    "ci": frozenset({"ci", "nsa_contract"}),
}
# Packages that must not import the GPU stack: the contract runs in the decide job without torch, and
# `ci` reads results files (a CUDA probe runs `python -c "import torch ..."` in a subprocess instead).
NO_GPU_STACK = frozenset({"nsa_contract", "ci"})
GPU_STACK = frozenset({"torch", "triton"})
IGNORED = ("bench/experiments",)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module of `from <...> import`, relative ones resolved against `module`."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _literal_head(arg: ast.expr) -> str | None:
    """The module name in `import_module("a.b")` or `import_module(f"a.b.{x}")` (its literal head)."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        head = str(arg.values[0].value)
        return head if "." in head else None  # `f"{x}"`-like: nothing known
    return None


def imports(path: Path, root: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module) of every import in `path`, wherever it stands in the file."""
    module = _module_name(path, root)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, _resolve(node, module, path.name == "__init__.py")
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.func, (ast.Attribute, ast.Name))
              and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"):
            name = _literal_head(node.args[0])
            if name:
                yield node.lineno, name


def modules(root: Path, layers: Mapping[str, frozenset[str]] = LAYERS,
            ignored: tuple[str, ...] = IGNORED) -> Iterator[tuple[str, Path]]:
    """(package, file) for every module of the layered packages under `root`."""
    for package in layers:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if not any(rel == i or rel.startswith(i + "/") for i in ignored):
                yield package, path


def upward(root: Path, layers: Mapping[str, frozenset[str]] = LAYERS,
           no_gpu_stack: frozenset[str] = NO_GPU_STACK, ignored: tuple[str, ...] = IGNORED) -> list[str]:
    """Every import that breaks the direction, as `path:line: <package> -> <module> (...)`."""
    found = []
    for package, path in modules(root, layers, ignored):
        for line, target in sorted(imports(path, root)):
            top = target.split(".")[0]
            where = f"{path.relative_to(root).as_posix()}:{line}: {package} -> {target}"
            if top in layers and top not in layers[package]:
                found.append(f"{where} (a {package} module may import only {', '.join(sorted(layers[package]))})")
            elif package in no_gpu_stack and top in GPU_STACK:
                found.append(f"{where} ({package} must run without {top})")
    return found


def test_no_arrow_runs_up() -> None:
    found = upward(REPO)
    assert not found, ("imports against the direction of DESIGN.md (move the shared code down into "
                       "nsa_contract, or the caller up):\n" + "\n".join(found))


def test_the_walk_sees_every_package_and_the_lazy_imports() -> None:
    """Not an empty walk: every layer has modules, and known arrows down are found, lazy ones included."""
    walked = {package: [p for q, p in modules(REPO) if q == package] for package in LAYERS}
    assert all(len(files) >= 5 for files in walked.values()), {k: len(v) for k, v in walked.items()}
    assert not any("experiments" in p.parts for files in walked.values() for p in files)
    found = {(p.relative_to(REPO).as_posix(), m) for _, p in modules(REPO) for _, m in imports(p, REPO)}
    assert ("nsa/dispatch.py", "nsa_contract") in found  # from nsa_contract import keys, settings
    assert ("bench/cli.py", "nsa") in found  # only inside functions: `from nsa import dispatch`
    assert any(p == "bench/suites/__init__.py" and m.startswith("bench.suites.") for p, m in found)  # import_module(f"")


def _tree(root: Path, files: Mapping[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    for package in LAYERS:
        (root / package).mkdir(exist_ok=True)
        (root / package / "__init__.py").touch()
    return root


def test_the_check_fails_on_arrows_that_run_up(tmp_path: Path) -> None:
    """The checker itself, on a synthetic tree: each kind of upward arrow is reported, the allowed ones
    and the ignored lab folder are not."""
    root = _tree(tmp_path, {
        "nsa_contract/keys.py": "def f():\n    from nsa import dispatch\n",  # lazy, inside a function
        "nsa_contract/schema.py": "import importlib\nimportlib.import_module('bench.cli')\n",
        "nsa/ops.py": "from nsa_contract import keys\nfrom . import dispatch\nfrom ci.decide import decide\n",
        "nsa/dispatch.py": "import torch\n",  # nsa may use torch
        "bench/cli.py": "from nsa import ops\nfrom nsa_contract import results\nfrom ..ci import report\n",
        "ci/decide.py": "from bench import results\nimport nsa.keys\n",
        "ci/report.py": "from .decide import decide\n\ndef plot():\n    import torch\n",
        "ci/sub/__init__.py": "from .. import decide\n",
        "bench/experiments/lab.py": "from ci import atomic\n",  # the lab notebook: not checked
    })
    found = upward(root)
    assert [line.split(" (")[0] for line in found] == [
        "nsa_contract/keys.py:2: nsa_contract -> nsa",
        "nsa_contract/schema.py:2: nsa_contract -> bench.cli",
        "nsa/ops.py:3: nsa -> ci.decide",
        "bench/cli.py:3: bench -> ci",  # relative `from ..ci` resolves above the package, to the top-level ci
        "ci/decide.py:1: ci -> bench",
        "ci/decide.py:2: ci -> nsa.keys",
        "ci/report.py:4: ci -> torch",
    ], found
    assert "may import only nsa, nsa_contract" in found[2] and "must run without torch" in found[-1]
