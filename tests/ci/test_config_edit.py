"""Golden-file tests of ci.config_edit: only the edited values change, every other byte is kept."""

from __future__ import annotations

import difflib
import io
import os
import re
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from ci.config_edit import ConfigEditError, apply_to_file, edit_thresholds, unified_diff
from nsa_contract import keys, settings, values
from tests.ci import fixtures as fx

GOLDEN = Path(__file__).parent / "golden"
REPO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "base.yaml"

PER_CLASS = {"g1": -1, "g2": 2048, "g4": 2048, "g8": 1024, "g16": 1024}
PER_CLASS_TEXT = "{g1: -1, g2: 2048, g4: 2048, g8: 1024, g16: 1024}"
# (input, profile, changes, golden tag): the expected file is <input>.<profile><tag>.expected.yaml.
GOLDEN_CASES = [
    ("config_base.yaml", "sm90", {"fa2_min_len_win": 4096, "fa2_min_len_cmp": 2048}, ""),
    ("config_base.yaml", "sm89", {"fa2_min_len_win": 8192}, ""),
    ("config_base.yaml", "sm80", {"triton_min_len_sel": 4096, "triton_min_len_cmp": 16384}, ""),
    ("config_base.yaml", "sm90", {"fa2_min_len_win": PER_CLASS, "triton_min_len_sel": {"g16": 512, "g1": -1}},
     "-classes"),
    ("config_odd_indent.yaml", "sm90", {"fa2_min_len_win": 16384, "fa2_min_len_cmp": 1024}, ""),
    ("config_flow.yaml", "sm90", {"fa2_min_len_win": 4096, "fa2_min_len_cmp": 512}, ""),
    ("config_flow.yaml", "sm89", {"fa2_min_len_cmp": {"g4": 2048}}, "-classes"),
]


def _read(path: Path) -> str:
    with open(path, encoding="utf-8", newline="") as fh:
        return fh.read()


def _changed_lines(old: str, new: str) -> list[tuple[str, str]]:
    old_lines, new_lines = old.splitlines(keepends=True), new.splitlines(keepends=True)
    assert len(old_lines) == len(new_lines)
    return [(a, b) for a, b in zip(old_lines, new_lines, strict=True) if a != b]


def _expected_path(name: str, profile: str, tag: str) -> Path:
    return GOLDEN / name.replace(".yaml", f".{profile}{tag}.expected.yaml")


@pytest.mark.parametrize("name,profile,changes,tag", GOLDEN_CASES,
                         ids=[f"{n}-{p}{t}" for n, p, _, t in GOLDEN_CASES])
def test_golden(name: str, profile: str, changes: dict[str, Any], tag: str) -> None:
    old = _read(GOLDEN / name)
    path = _expected_path(name, profile, tag)
    new = edit_thresholds(old, profile, changes)
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(new, encoding="utf-8")
    assert new == _read(path)
    changed = _changed_lines(old, new)
    # Exactly one changed line per edited key (flow style puts several keys on one line).
    assert 1 <= len(changed) <= len(changes)
    for _, line in changed:
        assert any(re.search(rf"\b{key}: +{re.escape(values.text(value))}(?!\d)", line)
                   for key, value in changes.items())
    # The one loader reads the intended values back, a mapping in class order.
    loaded = settings.load_text(new)
    for key, value in changes.items():
        assert loaded.written(key, profile) == value
        if isinstance(value, dict):
            assert list(loaded.written(key, profile)) == [c for c in keys.CLASSES if c in value]


def test_per_class_value_goes_back_to_a_plain_int_byte_for_byte() -> None:
    """int -> mapping -> int restores the original file exactly; the mapping is one flow line."""
    old = _read(GOLDEN / "config_base.yaml")
    per_class = edit_thresholds(old, "sm90", {"fa2_min_len_win": PER_CLASS})
    ((_, line),) = _changed_lines(old, per_class)
    assert line == f"    fa2_min_len_win: {PER_CLASS_TEXT}\n"
    assert settings.load_text(per_class).value("fa2_min_len_win", "sm90", "g8") == (1024, "config:profiles.sm90."
                                                                                     "fa2_min_len_win.g8")
    assert edit_thresholds(per_class, "sm90", {"fa2_min_len_win": -1}) == old
    # The same mapping again changes nothing; a different one rewrites only that line.
    assert edit_thresholds(per_class, "sm90", {"fa2_min_len_win": dict(reversed(PER_CLASS.items()))}) is per_class
    other = edit_thresholds(per_class, "sm90", {"fa2_min_len_win": {**PER_CLASS, "g1": 512}})
    assert _changed_lines(per_class, other) == [(line, line.replace("g1: -1", "g1: 512"))]


def test_mapping_with_a_comment_keeps_the_comment_column() -> None:
    # sm90 is the first profile, so the first 4-space triton_min_len_cmp line is its own.
    old = _read(GOLDEN / "config_base.yaml").replace(
        "    triton_min_len_cmp: -1\n", "    triton_min_len_cmp: {g1: -1, g16: 8192}        # tuned\n", 1)
    new = edit_thresholds(old, "sm90", {"triton_min_len_cmp": {"g4": 4096, "g16": 8192}})
    ((before, after),) = _changed_lines(old, new)
    assert after == "    triton_min_len_cmp: {g4: 4096, g16: 8192}      # tuned\n"
    assert after.index("#") == before.index("#")
    assert settings.load_text(new).written("triton_min_len_cmp", "sm90") == {"g4": 4096, "g16": 8192}
    assert settings.load_text(new).written("triton_min_len_cmp", "sm89") == -1


@pytest.mark.parametrize("before,after,changes", [
    ('    fa2_min_len_win: {"g1": 2048, "g16": -1}   # measured on H100\n',
     '    fa2_min_len_win: {"g1": 2048, "g16": 1024} # measured on H100\n', {"g1": 2048, "g16": 1024}),
    ("    fa2_min_len_win: { g1: 512 ,  g4: -1 }      # spaced\n",
     "    fa2_min_len_win: { g1: 40960 ,  g4: -1 }    # spaced\n", {"g1": 40960, "g4": -1}),
    ("    fa2_min_len_win: {'g16': 65536, g1: -1}  # quoted\n",
     "    fa2_min_len_win: {'g16': 1, g1: 2}       # quoted\n", {"g1": 2, "g16": 1}),
    ('    fa2_min_len_win: {"g1": 2048, "g16": -1}\n', '    fa2_min_len_win: {"g1": 2048, "g16": 1024}\n',
     {"g16": 1024, "g1": 2048}),
], ids=["json-style", "spaced", "quoted-reordered", "no-comment"])
def test_one_value_in_a_flow_mapping_keeps_every_other_byte(before: str, after: str, changes: dict) -> None:
    """A JSON-style flow map was re-written as `{g1: 2048, g16: 1024}` (quotes and spacing gone,
    the gap before its comment shrunk); a mapping that keeps its classes now has only the
    changed values rewritten, in place, and the comment keeps its column."""
    # sm90 is the first profile, so the first 4-space fa2_min_len_win line is its own.
    old = _read(GOLDEN / "config_base.yaml").replace("    fa2_min_len_win: -1\n", before, 1)
    assert before in old
    new = edit_thresholds(old, "sm90", {"fa2_min_len_win": changes})
    assert _changed_lines(old, new) == [(before, after)]
    assert settings.load_text(new).written("fa2_min_len_win", "sm90") == changes


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
    # sm80 is the last block, so its last key (triton_min_len_sel) is the file's last line.
    head, _, last = old.rpartition("\r\n")
    assert last == "    triton_min_len_sel: -1"
    new = edit_thresholds(old, "sm80", {"triton_min_len_sel": 512})
    assert new == head + "\r\n    triton_min_len_sel: 512"
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
    assert parsed["profiles"]["sm90"] == {**{k: -1 for k in keys.names()}, "triton_min_len_sel": 8192}
    assert parsed["runtime"]["triton_min_len_sel"] == -1 and parsed["profiles"]["sm89"]["triton_min_len_sel"] == -1


def test_no_change_returns_the_same_text() -> None:
    old = _read(GOLDEN / "config_base.yaml")
    assert edit_thresholds(old, "sm90", {"fa2_min_len_win": -1}) is old
    assert edit_thresholds(old, "sm90", {}) is old


SM90 = "profiles:\n  sm90:\n    fa2_min_len_win: {}\n"
ERROR_CASES = [
    # The one loader (nsa_contract.settings) refuses these files before any edit, with its own message.
    ("malformed", "profiles:\n  sm90: [\n", "sm90", {"fa2_min_len_win": 1}, r"must be valid YAML, got: .* line 3"),
    ("duplicate-key", "profiles:\n  sm90:\n    fa2_min_len_win: 1\n    fa2_min_len_win: 2\n", "sm90",
     {"fa2_min_len_win": 3}, r"key 'fa2_min_len_win' must appear once per mapping, got it twice \(line 4\)"),
    ("top-level-list", "- 1\n", "sm90", {}, r"must be a YAML mapping with sections .*, got list"),
    ("unknown-key", "profiles:\n  sm90:\n    fa2_min_len_wn: -1\n", "sm90", {},
     r"threshold key profiles\.sm90\.fa2_min_len_wn is unknown; did you mean profiles\.sm90\.fa2_min_len_win\?"),
    ("quoted-value", SM90.format("'-1'"), "sm90", {"fa2_min_len_win": 1},
     r"profiles\.sm90\.fa2_min_len_win must be -1 \(off\) or a sequence length >= 0, got '-1'"),
    ("unknown-class", SM90.format("{g3: 1}"), "sm90", {"fa2_min_len_win": 1}, r"class 'g3' is unknown"),
    ("merge-key", "runtime: &r\n  fa2_min_len_win: -1\nprofiles:\n  sm90:\n    <<: *r\n", "sm90",
     {"fa2_min_len_win": 1}, r"merge keys \(<<\) must not be used"),
    # Files the loader accepts that the edit cannot serve.
    ("no-profiles", "runtime: {}\n", "sm90", {}, r"must have a `profiles:` mapping, got nothing"),
    ("missing-profile", None, "sm75", {"fa2_min_len_win": 1}, r"profiles\.sm75 must be a mapping .* got no such "
     r"block .*sm90"),
    ("missing-key", "profiles:\n  sm90:\n    fa2_min_len_cmp: -1\n", "sm90", {"fa2_min_len_win": 1},
     r"profiles\.sm90\.fa2_min_len_win must exist .*edits never add keys"),
    ("undeclared-key", None, "sm90", {"fa2_min_len_sel": 1},
     r"profiles\.sm90\.fa2_min_len_sel must be a decision key declared in nsa_contract/keys\.py"),
    # Values the loader would refuse are refused with its words, before the file is touched.
    ("str-value", None, "sm90", {"fa2_min_len_win": "4096"}, r"must be -1 \(off\) or a sequence length >= 0, "
     r"got '4096'"),
    ("float-value", None, "sm90", {"fa2_min_len_win": 4096.0}, r"must be -1 \(off\) or a sequence length >= 0, "
     r"got 4096\.0"),
    ("bool-value", None, "sm90", {"fa2_min_len_win": True}, r"got the boolean True"),
    ("below-minus-one", None, "sm90", {"fa2_min_len_win": -2}, r"got -2; write an integer"),
    ("bad-class", None, "sm90", {"fa2_min_len_win": {"g32": 1}}, r"class 'g32' is unknown; classes are g1"),
    ("empty-mapping", None, "sm90", {"fa2_min_len_win": {}}, r"must name at least one class, got an empty mapping"),
    ("bad-class-value", None, "sm90", {"fa2_min_len_win": {"g4": "x"}}, r"fa2_min_len_win\.g4 must be -1"),
    # Layouts that cannot be edited on the value's own line.
    ("block-mapping", SM90.format("\n      g1: -1\n      g16: 1024"), "sm90", {"fa2_min_len_win": 5},
     r"must be an int or a one-line flow mapping .* got a block mapping; write it on one line as "
     r"`fa2_min_len_win: \{g1: -1, g16: 1024\}`"),
    ("tagged-scalar", SM90.format("!!int -1  # tagged"), "sm90", {"fa2_min_len_win": {"g1": 5}},
     r"must be a one-line value .* to be edited in place"),
    ("shared-anchor", "runtime: &b\n  fa2_min_len_win: -1\nprofiles:\n  sm90: *b\n", "sm90",
     {"fa2_min_len_win": 5}, r"must be editable without touching other lines"),
]


@pytest.mark.parametrize("text,profile,changes,match", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
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
    loader = _loader_message(original.decode(), str(path), profile, changes)
    if loader is not None:  # one loader: its refusal, word for word
        assert str(info.value) == loader
    else:  # config_edit's own: "<what> must <constraint>, got <actual>; <how to fix>"
        assert " must " in str(info.value) and ", got " in str(info.value) and "; " in str(info.value)


def _loader_message(text: str, source: str, profile: str, changes: dict[str, object]) -> str | None:
    """What nsa_contract.settings says about the file, or about one of the new values; None when it accepts both."""
    try:
        settings.load_text(text, source)
        for key, value in changes.items():
            if key in keys.names():
                settings.threshold(value, f"profiles.{profile}.{key}")
    except settings.SettingsError as exc:
        return str(exc)
    return None


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
