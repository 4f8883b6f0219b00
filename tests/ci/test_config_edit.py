"""Golden-file tests of ci.config_edit: only the edited values change, every other byte is kept."""

from __future__ import annotations

import difflib
import io
import os
import re
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from ci.config_edit import ConfigEditError, apply_to_file, edit_thresholds, unified_diff
from tests.ci import fixtures as fx

GOLDEN = Path(__file__).parent / "golden"
REPO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "base.yaml"

GOLDEN_CASES = [
    ("config_base.yaml", "sm90", {"fa2_min_len_win": 4096, "fa2_min_len_cmp": 2048}),
    ("config_base.yaml", "sm89", {"fa2_min_len_win": 8192}),
    ("config_base.yaml", "sm80", {"triton_min_len_sel": 4096, "triton_min_len_cmp": 16384}),
    ("config_odd_indent.yaml", "sm90", {"fa2_min_len_win": 16384, "fa2_min_len_cmp": 1024}),
    ("config_flow.yaml", "sm90", {"fa2_min_len_win": 4096, "fa2_min_len_cmp": 512}),
]


def _read(path: Path) -> str:
    with open(path, encoding="utf-8", newline="") as fh:
        return fh.read()


def _changed_lines(old: str, new: str) -> list[tuple[str, str]]:
    old_lines, new_lines = old.splitlines(keepends=True), new.splitlines(keepends=True)
    assert len(old_lines) == len(new_lines)
    return [(a, b) for a, b in zip(old_lines, new_lines, strict=True) if a != b]


@pytest.mark.parametrize("name,profile,changes", GOLDEN_CASES, ids=[f"{n}-{p}" for n, p, _ in GOLDEN_CASES])
def test_golden(name: str, profile: str, changes: dict[str, int]) -> None:
    old = _read(GOLDEN / name)
    expected = _read(GOLDEN / name.replace(".yaml", f".{profile}.expected.yaml"))
    new = edit_thresholds(old, profile, changes)
    assert new == expected
    changed = _changed_lines(old, new)
    # Exactly one changed line per edited key (flow style puts several keys on one line).
    assert 1 <= len(changed) <= len(changes)
    for _, line in changed:
        assert any(re.search(rf"\b{key}: +{value}\b", line) for key, value in changes.items())


def test_golden_base_matches_repo_config() -> None:
    """The golden input is the real config before any adoption, so the golden test covers what the PR
    edits: byte for byte once the real file's thresholds are set back to -1 (formatting or comment
    drift still fails; a merged threshold PR does not)."""
    golden = _read(GOLDEN / "config_base.yaml")
    assert fx.pristine_config_text(golden) == golden  # the golden holds no adopted threshold
    assert golden == fx.pristine_config_text(_read(REPO_CONFIG))


def test_pristine_config_changes_only_threshold_values() -> None:
    """The normalisation above rewrites threshold values and nothing else, under runtime too."""
    golden = _read(GOLDEN / "config_base.yaml")
    adopted = edit_thresholds(golden, "sm90", {"fa2_min_len_win": 2048, "triton_min_len_cmp": 8192})
    adopted = edit_thresholds(adopted, "sm80", {"fa2_min_len_cmp": 512})
    adopted = adopted.replace("  triton_min_len_sel: -1   #", "  triton_min_len_sel: 4096 #", 1)  # runtime
    assert len(_changed_lines(golden, adopted)) == 4
    assert fx.pristine_config_text(adopted) == golden
    drifted = golden.replace("# Hopper: H100, H200", "# Hopper", 1)
    assert fx.pristine_config_text(edit_thresholds(drifted, "sm90", {"fa2_min_len_win": 2048})) == drifted


def test_odd_layout_needs_the_fallback() -> None:
    """ruamel.yaml alone would re-indent this file; the token fallback must keep it byte for byte."""
    old = _read(GOLDEN / "config_odd_indent.yaml")
    yaml = YAML()
    doc = yaml.load(old)
    doc["profiles"]["sm90"]["fa2_min_len_win"] = 16384
    buf = io.StringIO()
    yaml.dump(doc, buf)
    removed = [d for d in difflib.ndiff(old.splitlines(), buf.getvalue().splitlines()) if d.startswith("- ")]
    assert len(removed) > 1  # ruamel touched more than the edited line
    new = edit_thresholds(old, "sm90", {"fa2_min_len_win": 16384})
    ((_, line),) = _changed_lines(old, new)
    # The trailing comment keeps its column.
    assert line.index("#") == old.splitlines()[8].index("#")


def test_crlf_and_missing_final_newline_kept() -> None:
    old = _read(GOLDEN / "config_base.yaml").replace("\n", "\r\n").rstrip("\r\n")
    new = edit_thresholds(old, "sm80", {"triton_min_len_cmp": 512})
    # sm80 is the last block, so its triton cmp key is the file's last line.
    head, _, last = old.rpartition("\r\n")
    assert last == "    triton_min_len_cmp: -1"
    assert new == head + "\r\n    triton_min_len_cmp: 512"
    assert not new.endswith("\n")
    assert new.count("\r\n") == old.count("\r\n")


def test_only_the_named_profile_changes() -> None:
    old = _read(GOLDEN / "config_base.yaml")
    new = edit_thresholds(old, "sm80", {"fa2_min_len_win": 2048})
    yaml = YAML(typ="safe", pure=True)
    before, after = yaml.load(old), yaml.load(new)
    before["profiles"]["sm80"]["fa2_min_len_win"] = 2048
    assert after == before
    assert after["runtime"]["fa2_min_len_win"] == -1


def test_triton_key_edit_keeps_the_fa2_keys_and_other_profiles() -> None:
    old = _read(GOLDEN / "config_base.yaml")
    new = edit_thresholds(old, "sm90", {"triton_min_len_sel": 8192})
    ((before, after),) = _changed_lines(old, new)
    assert (before, after) == ("    triton_min_len_sel: -1\n", "    triton_min_len_sel: 8192\n")
    yaml = YAML(typ="safe", pure=True)
    parsed = yaml.load(new)
    assert parsed["profiles"]["sm90"] == {"fa2_min_len_win": -1, "fa2_min_len_cmp": -1, "triton_min_len_sel": 8192,
                                          "triton_min_len_cmp": -1}
    assert parsed["runtime"]["triton_min_len_sel"] == -1 and parsed["profiles"]["sm89"]["triton_min_len_sel"] == -1


def test_no_change_returns_the_same_text() -> None:
    old = _read(GOLDEN / "config_base.yaml")
    assert edit_thresholds(old, "sm90", {"fa2_min_len_win": -1}) is old
    assert edit_thresholds(old, "sm90", {}) is old


@pytest.mark.parametrize(
    "text,profile,changes,match",
    [
        ("profiles:\n  sm90: [\n", "sm90", {"fa2_min_len_win": 1}, r"must be valid YAML, got .* line 3"),
        (
            "profiles:\n  sm90:\n    a: 1\n    a: 2\n",
            "sm90",
            {"a": 3},
            r"must be valid YAML, got found duplicate",
        ),
        ("- 1\n", "sm90", {}, r"must be a YAML mapping at the top level, got a list"),
        ("runtime: {}\n", "sm90", {}, r"must have a `profiles:` mapping, got nothing"),
        (
            None,
            "sm75",
            {"fa2_min_len_win": 1},
            r"profiles\.sm75 must be a mapping .* got no such block .*sm90",
        ),
        (
            None,
            "sm90",
            {"fa2_min_len_sel": 1},
            r"profiles\.sm90\.fa2_min_len_sel must exist .*edits never add keys",
        ),
        (None, "sm90", {"fa2_min_len_win": "4096"}, r"must be set to an int, got '4096' \(str\)"),
        (None, "sm90", {"fa2_min_len_win": 4096.0}, r"must be set to an int, got 4096\.0 \(float\)"),
        (None, "sm90", {"fa2_min_len_win": True}, r"must be set to an int, got True \(bool\)"),
        (
            "profiles:\n  sm90:\n    k: {a: 1}\n",
            "sm90",
            {"k": 5},
            r"must hold a single value .* got a mapping",
        ),
        ("profiles:\n  sm90:\n    k: |\n      -1\n", "sm90", {"k": 5}, r"must be a one-line scalar"),
        (
            "base: &b\n  k: -1\nprofiles:\n  sm90: *b\n",
            "sm90",
            {"k": 5},
            r"must be editable without touching other lines",
        ),
    ],
    ids=[
        "malformed",
        "duplicate-key",
        "top-level-list",
        "no-profiles",
        "missing-profile",
        "missing-key",
        "str-value",
        "float-value",
        "bool-value",
        "mapping-value",
        "block-scalar",
        "shared-anchor",
    ],
)
def test_errors_leave_the_file_untouched(
    tmp_path: Path, text: str | None, profile: str, changes: dict[str, object], match: str
) -> None:
    path = tmp_path / "base.yaml"
    original = (text if text is not None else _read(GOLDEN / "config_base.yaml")).encode()
    path.write_bytes(original)
    before = os.stat(path)
    with pytest.raises(ConfigEditError, match=match) as info:
        apply_to_file(path, profile, changes)  # type: ignore[arg-type]
    assert path.read_bytes() == original
    assert os.stat(path).st_mtime_ns == before.st_mtime_ns
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind
    # "<what> must <constraint>, got <actual>; <how to fix>"
    assert " must " in str(info.value) and ", got " in str(info.value) and "; " in str(info.value)


def test_apply_to_file_writes_and_returns_the_diff(tmp_path: Path) -> None:
    path = tmp_path / "base.yaml"
    path.write_bytes((GOLDEN / "config_base.yaml").read_bytes())
    path.chmod(0o640)
    diff = apply_to_file(path, "sm90", {"fa2_min_len_win": 4096, "fa2_min_len_cmp": 2048})
    assert path.read_bytes() == (GOLDEN / "config_base.sm90.expected.yaml").read_bytes()
    assert oct(path.stat().st_mode & 0o777) == oct(0o640)
    minus = [line for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    plus = [line for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert minus == ["-    fa2_min_len_win: -1", "-    fa2_min_len_cmp: -1"]
    assert plus == ["+    fa2_min_len_win: 4096", "+    fa2_min_len_cmp: 2048"]
    assert list(tmp_path.iterdir()) == [path]
    # A second application changes nothing and writes nothing.
    mtime = path.stat().st_mtime_ns
    assert apply_to_file(path, "sm90", {"fa2_min_len_win": 4096}) == ""
    assert path.stat().st_mtime_ns == mtime


def test_apply_to_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigEditError, match=r"config path must be a readable file.*pass --config"):
        apply_to_file(tmp_path / "nope.yaml", "sm90", {"fa2_min_len_win": 1})


def test_unified_diff_is_empty_without_change() -> None:
    assert unified_diff("a\n", "a\n", "x.yaml") == ""
    assert unified_diff("a\n", "b\n", "x.yaml").startswith("--- a/x.yaml\n+++ b/x.yaml\n")
