"""`python -m ci <subcommand>`: the CPU stages of the benchmark pipeline.

Subcommands are registered as `Subcommand` records (name, help, arguments, run function), so a
new stage is one `register(...)` call. Exit codes: 0 ok, 1 a stage could not finish (GitHub, the
sweep), 2 bad input or a file-system fault (a full disk, an unwritable folder; one line with the
path and the fix), 3 parity failure (`decide` still
writes its file), 4 a regression (`history` and `pipeline`, after every file is written).
`pipeline` runs the stages in order; `workflow-steps` runs a workflow job here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from ci import guard
from ci.args import parse_margin
from nsa_contract import exits
from nsa_contract.paths import InputError, check_out_dir, check_out_file, check_yaml_file, file_system_error

# Stage modules that pull in numpy, PyYAML or Jinja (decide, report) are imported when their
# subcommand runs: `guard` must work on a runner before anything is installed.
CONFIG_FIX = "pass --config configs/base.yaml"
# What the `pipeline` extra installs (pyproject.toml), by import name: without them a stage cannot run.
PIPELINE_MODULES = ("numpy", "jinja2", "matplotlib", "github", "ruamel", "requests", "yaml")
PIPELINE_FIX = 'run `pip install -e ".[pipeline]"` in the checkout (`make setup` does, with the dev tools)'
CONFIG_FIXES = {"NSA_CONFIG": "set NSA_CONFIG to a config file, or unset it for the default",
                "the default config": "restore configs/base.yaml, or reinstall the package"}


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS: dict[str, Subcommand] = {}


def register(sub: Subcommand) -> Subcommand:
    if sub.name in SUBCOMMANDS:
        raise ValueError(f"subcommand names must be unique, got {sub.name!r} twice")
    SUBCOMMANDS[sub.name] = sub
    return sub


def _decide_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--results", nargs="+", required=True, metavar="RESULTS.json",
                   help="results files of one GPU architecture (shards of one run; case ids must be unique)")
    p.add_argument("--config", default=None,
                   help="config with nsa grid, decide.margin/confidence and current thresholds "
                        "(default: $NSA_CONFIG when set, else configs/base.yaml of the checkout, else the copy "
                        "installed with the package)")
    p.add_argument("--margin", type=parse_margin, default=None,
                   help="speedup the CI lower bound must clear to adopt a candidate (FA-2, Triton); empty or absent: the "
                        "config's decide.margin")
    p.add_argument("--out", default="out/decision.json", help="decision file to write (default: %(default)s)")


def _decide_run(args: argparse.Namespace) -> int:
    from ci import decide
    from nsa_contract.settings import config_source

    path, source = config_source(args.config)
    config = str(path)
    check_yaml_file(config, source, CONFIG_FIXES.get(source, CONFIG_FIX))
    check_out_file(args.out, "--out")
    doc = decide.decide_files(args.results, config, args.margin)
    decide.write_decision(doc, args.out)
    for line in decide.summary_lines(doc):
        print(line)
    if doc["exit_code"]:
        n = sum(f["parity_failed"] for f in doc["failures"])
        print(f"error: {n} parity failure(s); see 'failures' in {args.out}", file=sys.stderr)
    return doc["exit_code"]


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decision", required=True, help="decision file written by `python -m ci decide`")
    p.add_argument("--previous", default=None,
                   help="previous run (results or decision file) to compare case timings with")
    p.add_argument("--trends", default=None, metavar="DIR",
                   help="folder of trend_*.png from `ci history` (its --out-dir/trends, e.g. out/history/trends): "
                        "copied into --out-dir and shown in the history section; an absent folder shows none")
    p.add_argument("--out-dir", default="out/report",
                   help="folder for report.md, summary.md and speedup_<branch>.png (default: %(default)s)")
    p.add_argument("--summary-to", default=None, metavar="FILE",
                   help='also append summary.md to FILE, e.g. "$GITHUB_STEP_SUMMARY" in Actions '
                        "(empty: skip, as when that variable is unset)")


def _report_run(args: argparse.Namespace) -> int:
    from ci import report

    check_out_dir(args.out_dir, "--out-dir", replaced=True)
    written = report.write_report(args.decision, args.out_dir, args.previous, args.trends)
    for path in written:
        print(path)
    if args.summary_to is not None:
        summary = next(p for p in written if p.name == "summary.md")
        if report.append_summary(summary, args.summary_to):
            print(f"appended {summary} to {args.summary_to}")
        else:
            print("--summary-to is empty: summary not appended", file=sys.stderr)
    return 0


register(Subcommand(
    "decide", "turn results files into one threshold proposal per key (fa2_*, triton_*)",
    "Pair each masked-SDPA case with its candidate case (FA-2 in suite fa2, the own Triton kernels in "
    "suite triton), bootstrap the speedup interval, and apply the threshold rule of "
    "docs/pipeline.md. Writes a decision JSON file and prints one line per threshold key. Exit 0 ok, 2 bad input, 3 parity failure (the file is still written).",
    _decide_args, _decide_run))
register(Subcommand(
    "report", "render a decision file as report.md, summary.md and plots",
    "Render the markdown report (also the threshold PR body), a short summary for "
    "$GITHUB_STEP_SUMMARY and one speedup-vs-length PNG per branch. A decision rewritten by `ci history` "
    "also gets its regressions (first) and a history section with the trend charts of --trends. "
    "Exit 0 ok, 2 bad input.",
    _report_args, _report_run))
register(Subcommand("guard", guard.HELP, guard.__doc__ or "", guard.add_arguments, guard.run))


def _register_stages() -> None:
    """The stages whose modules pull in PyYAML, numpy or PyGithub: registered on first use, so that
    importing this module (and `python -m ci guard`) needs nothing installed."""
    if "pipeline" in SUBCOMMANDS:
        return
    from ci import history_cmd, pipeline, pr_cmd, workflow_steps

    register(Subcommand("history", *history_cmd.FIELDS))
    register(Subcommand("pr", pr_cmd.HELP, pr_cmd.DESCRIPTION, pr_cmd.add_arguments, pr_cmd.run))
    register(Subcommand("pipeline", pipeline.HELP, pipeline.__doc__ or "", pipeline.add_arguments,
                        lambda args: pipeline.run(args, stage=main)))
    register(Subcommand("workflow-steps", workflow_steps.HELP, workflow_steps.__doc__ or "",
                        workflow_steps.add_arguments, workflow_steps.run))


def build_parser(stages: bool = True) -> argparse.ArgumentParser:
    """The CLI; `stages=False` registers only what needs nothing installed (decide/report import lazily, guard)."""
    if stages:
        _register_stages()
    parser = argparse.ArgumentParser(prog="python -m ci", description=__doc__.splitlines()[0])
    subs = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for sub in SUBCOMMANDS.values():
        # A description with its own line breaks (a module docstring) keeps them; one paragraph reflows.
        formatter = argparse.RawDescriptionHelpFormatter if "\n" in sub.description else argparse.HelpFormatter
        p = subs.add_parser(sub.name, help=sub.help, description=sub.description, formatter_class=formatter)
        sub.add_arguments(p)
        p.set_defaults(run=sub.run)
    return parser


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    """The exception types that mean bad input (exit 2), from the stage modules loaded so far.

    A stage module that was never imported cannot have raised its error, so looking them up in
    sys.modules keeps `guard` free of their dependencies.
    """
    from nsa_contract.results import ResultsError

    found: list[type[BaseException]] = [InputError, ResultsError]
    for module, name in (("ci.decide", "DecideError"), ("ci.report", "ReportError")):
        if module in sys.modules:
            found.append(getattr(sys.modules[module], name))
    return tuple(found)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(stages=argv[:1] != ["guard"]).parse_args(argv)
        return args.run(args)
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in PIPELINE_MODULES:
            raise
        print(f"error: the pipeline needs the module {exc.name}, which is not installed; {PIPELINE_FIX}",
              file=sys.stderr)
        return exits.BAD_INPUT
    except Exception as exc:
        # A file-system fault (a full disk, `ulimit -f`, a folder that cannot be written) is bad input
        # too: one line with the path and the fix, not a traceback.
        message = file_system_error(exc)
        if message is None and not isinstance(exc, _bad_input_errors()):
            raise
        print(f"error: {message or exc}", file=sys.stderr)
        return exits.BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
