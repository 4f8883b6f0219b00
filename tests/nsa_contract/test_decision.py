"""nsa_contract.decision: the one validation of decision.json, its typed view and its round trip; and
`ci history`, `ci report` and `ci pr` refusing a broken file with the same words."""

from __future__ import annotations

import copy
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ci import decide
from ci.__main__ import main
from ci.pr_cmd import run_pr
from nsa_contract import exits, keys
from nsa_contract.decision import Decision, DecisionError
from tests.ci import fixtures as fx


@pytest.fixture(scope="module")
def written() -> dict[str, Any]:
    """A decision as `ci decide` writes it: the win key proposes 2048 in class g4, the others keep -1."""
    cfg = decide.DecideConfig.from_mapping(fx.config())
    return decide.decide([("r.json", fx.document(fx.sweep("sliding", fx.WIN_ADOPT_FROM_2048)))], cfg)


def test_what_decide_writes_is_valid_and_round_trips(written: dict[str, Any], tmp_path: Path) -> None:
    assert Decision.validate(written) == []
    decision = Decision.from_dict(written)
    path = decision.write(tmp_path / "d.json")
    again = Decision.load(path)
    assert again.to_dict() == written and again.to_json() == path.read_text(encoding="utf-8")
    win = again.branches["win"]
    assert (again.profile, again.exit_code, again.history, again.per_class) == ("sm90", 0, None, True)
    assert (win.key, win.suite, win.current, win.changed) == ("fa2_min_len_win", "fa2", -1, True)
    assert set(win.classes) == set(keys.CLASSES) and win.classes["g4"].proposed == 2048
    assert win.classes["g4"].tested == tuple(sorted(x["T"] for x in written["branches"]["win"]["classes"]["g4"]
                                                    ["lengths"]))
    assert [b.key for b in again.branches.values()] == list(keys.names())


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A change of the document: `branches.win.classes.g4.proposed` set to `value` (or deleted: ...)."""
    def change(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target = doc
        for name in parents:
            target = target[int(name)] if isinstance(target, list) else target[name]
        if value is ...:
            del target[last]
        else:
            target[last] = value
    return change


BROKEN = {
    "another schema": (_set("schema", "nsa-decision/1"), "decision.schema must be 'nsa-decision/2', got 'nsa-decision/1'"),
    "no profile": (_set("profile", ...), "decision.profile must be a profile such as 'sm90' or 'cpu', got None"),
    "empty gpu name": (_set("gpu_name", " "), "decision.gpu_name must be a non-empty string"),
    "exit code 1": (_set("exit_code", 1), "decision.exit_code must be 0 or 3, got 1"),
    "no branches": (_set("branches", {}), "decision.branches must be a non-empty mapping"),
    "branch without suite": (_set("branches.win.suite", ...), "decision.branches.win must have key (str), current "
                             "and proposed (int or class -> int), changed (bool) and suite (str)"),
    "class proposes -5": (_set("branches.win.classes.g1.proposed", -5),
                          "decision.branches.win.classes.g1.proposed must be -1 (off) or a sequence length >= 0"),
    "class says unchanged": (_set("branches.win.classes.g4.changed", False),
                             "decision.branches.win.classes.g4.changed must say whether proposed differs"),
    "branch value not its classes'": (_set("branches.win.proposed", 2048),
                                      "decision.branches.win.proposed must be what its classes hold "
                                      "({g1: -1, g2: -1, g4: 2048, g8: -1, g16: -1}), got 2048"),
    "class of another key": (_set("branches.win.classes.g4.key", "fa2_min_len_cmp"),
                             "decision.branches.win.classes.g4 must be the entry of (fa2_min_len_win, g4)"),
    "unknown class": (lambda d: d["branches"]["win"]["classes"].update(g3=d["branches"]["win"]["classes"]["g1"]),
                      "class 'g3' is unknown"),
    "lengths not a list": (_set("branches.win.classes.g2.lengths", None),
                           "decision.branches.win.classes.g2.lengths must be a list of {T: int, ...}"),
    "decisions miss an entry": (lambda d: d["decisions"].pop(), "decision.decisions must list the same (key, class) "
                                "entries as the branches' classes"),
}


@pytest.mark.parametrize("name", BROKEN)
def test_each_rule_refuses_its_break_with_the_fix(written: dict[str, Any], name: str) -> None:
    change, message = BROKEN[name]
    doc = copy.deepcopy(written)
    change(doc)
    problems = Decision.validate(doc)
    assert any(message in p for p in problems), problems
    with pytest.raises(DecisionError, match=r"^mine must follow decision schema nsa-decision/2, got \d+ problem") as info:
        Decision.from_dict(doc, "mine")
    assert message in str(info.value) and "rerun `python -m ci decide`" in str(info.value)


def test_a_branch_without_classes_stands_for_every_class(written: dict[str, Any]) -> None:
    doc = copy.deepcopy(written)
    del doc["decisions"]
    win = doc["branches"]["win"]
    del win["classes"]
    decision = Decision.from_dict(doc)
    assert decision.branches["win"].classes == {} and not decision.per_class
    win["lengths"] = "none"
    assert Decision.validate(doc) == ["decision.branches.win.lengths must be a list of {T: int, ...}, got 'none'"]


@pytest.mark.parametrize("text,message", [
    ("{", "must be JSON, got a parse error"),
    ('{"schema": NaN}', "must be JSON, got a parse error (NaN is not a finite number"),
    ("[]", "decision must be a JSON object, got list"),
])
def test_text_that_is_no_decision(text: str, message: str) -> None:
    with pytest.raises(DecisionError, match=r"^d\.json must") as info:
        Decision.from_json(text, "d.json")
    assert message in str(info.value)


def test_history_report_and_pr_refuse_a_broken_decision_in_the_same_words(
        written: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One validation: the three stages that read decision.json name the same problem, with exit 2."""
    for name in ("GITHUB_TOKEN", "GH_TOKEN", "GITHUB_OUTPUT", "NSA_HISTORY_DIR", "NSA_PR_DRY_RUN", "NSA_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    results = tmp_path / "r.json"
    results.write_text(json.dumps(fx.document(fx.sweep("sliding", fx.WIN_ADOPT_FROM_2048))), encoding="utf-8")
    doc = copy.deepcopy(written)
    doc["branches"]["win"]["classes"]["g4"]["changed"] = False
    broken = tmp_path / "d.json"
    broken.write_text(json.dumps(doc), encoding="utf-8")
    problem = "decision.branches.win.classes.g4.changed must say whether proposed differs from current"
    report = tmp_path / "report"
    report.mkdir()
    (report / "report.md").write_text("# r\n", encoding="utf-8")
    assert main(["history", "--results", str(results), "--decision", str(broken), "--out-dir", str(tmp_path / "h"),
                 "--dry-run"]) == exits.BAD_INPUT
    assert main(["report", "--decision", str(broken), "--out-dir", str(tmp_path / "rep")]) == exits.BAD_INPUT
    seen = capsys.readouterr().err.splitlines()
    err = io.StringIO()
    assert run_pr(["--decision", str(broken), "--report-dir", str(report), "--out-dir", str(tmp_path / "pr")],
                  env={}, out=io.StringIO(), err=err) == exits.BAD_INPUT
    seen += err.getvalue().splitlines()
    assert len(seen) == 3 and all(problem in line for line in seen), seen
    assert json.loads(broken.read_text(encoding="utf-8")) == doc  # nothing rewritten
    assert not any((tmp_path / d).exists() for d in ("h", "rep", "pr"))

