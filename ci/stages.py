"""The pipeline's stages, in order: one list for `python -m ci pipeline` and the GPU workflow.

`ci pipeline` runs them in this order on one machine (ci/pipeline.py); the GPU workflow
(.github/workflows/gpu-bench.yml) runs the same commands, in the same order, as steps of its two
jobs: the sweep on the GPU runner (`gpu`), the rest in the job that holds the write token
(`decide`). tests/test_workflows.py fails when the workflow's `python -m bench` / `python -m ci`
steps differ from this list. Adding a stage: its subcommand (ci/__main__.py), an entry here, its
runner in ci/pipeline.py and its step in the workflow (DESIGN.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    name: str
    command: tuple[str, str]  # `python -m <module> <subcommand>`
    job: str  # the GPU workflow's job that runs it
    writes: str  # what it writes: a file or folder under `ci pipeline --out-dir` (the workflow's out/)
    what: str

    @property
    def argv(self) -> list[str]:
        return ["python", "-m", *self.command]


STAGES: tuple[Stage, ...] = (
    Stage("sweep", ("bench", "run"), "gpu", "results.json", "time the suites (the only stage that needs torch)"),
    Stage("decide", ("ci", "decide"), "decide", "decision.json", "one threshold proposal per key and class"),
    Stage("history", ("ci", "history"), "decide", "history",
          "keep only changes that last K runs; record the run; flag regressions"),
    Stage("report", ("ci", "report"), "decide", "report", "report.md, summary.md, plots"),
    Stage("pr", ("ci", "pr"), "decide", "pr", "open, update or close the threshold PR (or a dry run)"),
)
NAMES = tuple(s.name for s in STAGES)


def get(name: str) -> Stage:
    for stage in STAGES:
        if stage.name == name:
            return stage
    raise KeyError(f"stage must be one of {', '.join(NAMES)}, got {name!r}")
