"""`python -m bench`: run suites into one results file, list case ids, merge shard files.

    python -m bench run --suites fa2,triton,calibration --size nightly --out results/x.json
    python -m bench list --suites fa2 --size nightly
    python -m bench merge shard0.json shard1.json --out all.json
    python -m bench readme-table --readme README.md    # a tool: see `python -m bench TOOL --help`

Exit codes: 0 done; 1 a run could not finish (the message says why); 2 bad usage or bad input
(a merge's shard files, an --out that is a folder, a full disk or an unwritable folder), with a
message saying how to fix it;
3 `--strict` and some case failed (parity or an exception).
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import suites
from bench.cases import SIZES, Cell, shard
from bench.timing import Timer
from nsa_contract import exits, keys, results
from nsa_contract import suites as lists

# Tools beside the suites: each a module with its own `main(argv) -> int` and --help.
TOOLS = {
    "readme-table": ("bench.readme_table", "regenerate the README's results table from a results file"),
    "forward-ab": ("bench.forward_ab", "time the whole NSA forward under several Tiles variants, interleaved (CUDA)"),
}


def _csv_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _shard_arg(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard must be i/N such as 0/4, got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"--shard must be i/N with 0 <= i < N, got {text!r}")
    return i, n


def add_timer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("timing (defaults depend on --size)")
    g.add_argument("--warmup-ms", type=float, help="warmup budget per candidate, ms")
    g.add_argument("--rep-ms", type=float, help="repeat budget, ms (sized by the slowest candidate of a cell)")
    g.add_argument("--warmup", type=int, help="warmup calls per candidate (overrides --warmup-ms)")
    g.add_argument("--rep", type=int, help="timed repeats per candidate (overrides --rep-ms)")
    g.add_argument("--block", type=int, help="repeats per candidate before switching (interleave block)")
    g.add_argument("--no-l2-flush", action="store_true", help="do not zero 256 MiB of L2 between repeats")
    g.add_argument("--cuda-graph", action="store_true", help="time CUDA graph replays (microsecond kernels)")


def timer_from(args: argparse.Namespace, size: str) -> Timer:
    from dataclasses import replace

    from bench.runner import TIMERS

    timer = TIMERS[size]
    changes: dict[str, Any] = {}
    for name in ("warmup_ms", "rep_ms", "warmup", "rep", "block"):
        if getattr(args, name, None) is not None:
            changes[name] = getattr(args, name)
    if getattr(args, "no_l2_flush", False):
        changes["l2_flush"] = False
    if getattr(args, "cuda_graph", False):
        changes["cuda_graph"] = True
    if changes.get("rep") is not None:
        changes["min_rep"] = min(timer.min_rep, changes["rep"])
    return replace(timer, **changes)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    suite_help = (f"comma-separated, from {', '.join(suites.SUITES)}; or a list: all (every suite), "
                  + ", ".join(f"{name} ({lists.joined(names)})" for name, names in lists.SETS.items())
                  + " (default: %(default)s)")

    run = sub.add_parser("run", help="run suites and write one results file")
    run.add_argument("--suites", default=lists.joined(lists.DEFAULT), help=suite_help)
    run.add_argument("--size", choices=SIZES, default="smoke")
    run.add_argument("--out", default="out/results.json", help="results file to write")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    run.add_argument("--gpus", type=int, help="GPUs to shard cells over, one process each (default: all visible)")
    run.add_argument("--backends", type=_csv_list, help="keep only these requested backends, e.g. sdpa,fa2")
    run.add_argument("--csv", help="also write the decode suite's legacy CSV here")
    run.add_argument("--fa2", choices=("auto", "off", "force"), default="auto",
                     help="nsa dispatch override for backend=auto paths (recorded in the results)")
    run.add_argument("--triton", choices=("auto", "off"), default="auto",
                     help="nsa dispatch override: off sets every triton_* threshold to -1 for backend=auto "
                          "paths (recorded in the results)")
    for key in keys.KEYS:  # one flag per decision key, from its one declaration
        run.add_argument(key.flag, type=_threshold_arg, dest=key.name, metavar="N",
                         help=f"override {key.name} (the {key.branch} branch on {key.label}) for every class "
                              "and profile: a length, or -1 for off (recorded in the results)")
    run.add_argument("--strict", action="store_true", help="exit 3 when any case failed")
    run.add_argument("--shard", type=_shard_arg, help=argparse.SUPPRESS)
    add_timer_args(run)

    lst = sub.add_parser("list", help="print the case ids a run would produce, without running")
    lst.add_argument("--suites", default=lists.joined(lists.DEFAULT), help=suite_help)
    lst.add_argument("--size", choices=SIZES, default="smoke")
    lst.add_argument("--backends", type=_csv_list)

    merge = sub.add_parser("merge", help="merge shard results files of one run into one")
    merge.add_argument("files", nargs="+")
    merge.add_argument("--out", required=True)
    for name, (_, help_text) in TOOLS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOLS:
        return importlib.import_module(TOOLS[argv[0]][0]).main(argv[1:])
    args = _parser().parse_args(argv)
    command = shlex.join(["python", "-m", "bench", *argv])
    try:
        if args.cmd == "list":
            return _list(args)
        if args.cmd == "merge":
            return _merge(args)
        _check_out(args.out, "--out")
        if args.csv:
            _check_out(args.csv, "--csv")
        names = _suites(args.suites)
        cells = suites.cells(names, args.size, args.backends)
        return execute(cells, args, command=command, size=args.size, suite_names=names, shard_argv=argv)
    except (ValueError, results.ResultsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exits.BAD_INPUT if isinstance(exc, ValueError) and not isinstance(exc, results.ResultsError) \
            else exits.ERROR
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exits.ERROR
    except OSError as exc:  # a full disk, `ulimit -f`, an unwritable folder: one line with the path and the fix
        from nsa_contract.paths import file_system_error

        message = file_system_error(exc)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return exits.BAD_INPUT


def _suites(text: str) -> list[str]:
    """`--suites` parsed, with the fix added to the error: the CLI's errors say how to recover."""
    try:
        return suites.parse(text)
    except ValueError as exc:
        raise ValueError(f"{exc}; pass --suites with names from that list, comma-separated") from None


def _list(args: argparse.Namespace) -> int:
    cells = suites.cells(_suites(args.suites), args.size, args.backends)
    print(f"# {sum(len(c.variants) for c in cells)} cases in {len(cells)} cells; aliases such as fa2 "
          "resolve to the backend that runs (flash_attn or torch_fa2) in results files")
    try:
        for cell in cells:
            for v in cell.variants:
                print(cell.case_id(v))
        sys.stdout.flush()
    except BrokenPipeError:  # `| head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return exits.OK


def _check_out(path: str, flag: str) -> None:
    """Refuse an output path that cannot be written before any case runs (a sweep takes hours)."""
    from nsa_contract.paths import InputError, check_out_file

    try:
        check_out_file(path, flag)
    except InputError as exc:
        raise ValueError(str(exc)) from None


def _merge(args: argparse.Namespace) -> int:
    try:
        _check_out(args.out, "--out")
        doc = results.merge([results.load(f) for f in args.files])
    except results.ResultsError as exc:  # the shard files are the input here: exit 2, not 1
        raise ValueError(str(exc)) from None
    results.dump(doc, args.out)
    print(f"merged {len(args.files)} files, {len(doc['cases'])} cases -> {args.out}", file=sys.stderr)
    return exits.OK


def _threshold_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -2
    if value < -1:
        raise argparse.ArgumentTypeError(f"a threshold must be -1 (off) or a length >= 0, got {text!r}")
    return value


def _apply_dispatch(fa2: str, triton: str, values: dict[str, int | None] | None = None) -> None:
    """`--fa2 off|force`, `--triton off` and `--<key> N` as nsa.dispatch overrides (unset: the config's)."""
    overrides: dict[str, Any] = {k: v for k, v in (values or {}).items() if v is not None}
    if fa2 != "auto":
        overrides.update({"use_fa2": False} if fa2 == "off" else {"force_fa2": True})
    if triton == "off":
        overrides["use_triton"] = False
    if not overrides:
        return
    from nsa import dispatch

    dispatch.set_overrides(**overrides)


def _visible_gpus() -> list[str]:
    import torch

    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None and env.strip():
        return [x.strip() for x in env.split(",") if x.strip()][:torch.cuda.device_count()]
    return [str(i) for i in range(torch.cuda.device_count())]


def execute(cells: list[Cell], args: argparse.Namespace, *, command: str, size: str,
            suite_names: list[str], shard_argv: list[str] | None = None) -> int:
    """Run `cells` as `args` say (device, timer, out, csv); the wrappers call this too.

    With `shard_argv` (the `python -m bench` arguments that produced `cells`) and several GPUs,
    the cells are sharded over one subprocess per GPU instead.
    """
    from bench import machine, runner

    device = runner.resolve_device(args.device)
    shard_arg = getattr(args, "shard", None)
    if device == "cuda" and shard_arg is None and shard_argv is not None:
        gpus = _visible_gpus()
        n_gpus = len(gpus) if args.gpus is None else min(max(args.gpus, 1), len(gpus))
        if n_gpus > 1:
            return _run_shards(args, command, shard_argv, gpus[:n_gpus])
    triton = getattr(args, "triton", "auto")  # the bench/ wrappers have no --triton
    _apply_dispatch(args.fa2, triton, {k.name: getattr(args, k.name, None) for k in keys.KEYS})
    _check_dispatch(device)
    timer = timer_from(args, size)
    opts = runner.RunOptions(device=device, timer=timer,
                             prefix=f"[shard {shard_arg[0]}/{shard_arg[1]}] " if shard_arg else "")
    todo = shard(cells, *shard_arg) if shard_arg else list(enumerate(cells))
    print(f"{opts.prefix}bench: {len(todo)} cells, {sum(len(c.variants) for _, c in todo)} cases on "
          f"{device}; suites {','.join(suite_names)} size {size} -> {args.out}", file=sys.stderr, flush=True)
    info = machine.machine_info(device)
    cases = runner.run_cells(todo, opts)
    if device == "cuda":
        info["nvml_end"] = machine.nvml_snapshot()
    extra = {"suites": suite_names, "size": size, "fa2": args.fa2, "triton": triton}
    if shard_arg:
        extra["shard"] = f"{shard_arg[0]}/{shard_arg[1]}"
    doc = runner.document(cases, opts, command=command, git_sha=machine.git_sha(), machine=info,
                          extra_run=extra)
    return _finish(doc, args)


def _check_dispatch(device: str) -> None:
    """Read the thresholds in force once, before any cell: a bad override (NSA_PROFILE, NSA_<KEY>,
    NSA_USE_*, NSA_CONFIG) stops the run here with its one-line error (ValueError: exit 2), on a CPU
    too, where no call would read them and a sweep would otherwise record the error and go on."""
    import torch

    from nsa import dispatch

    dispatch.describe(torch.device(device))


def _finish(doc: dict[str, Any], args: argparse.Namespace) -> int:
    results.dump(doc, args.out)
    if getattr(args, "csv", None):
        from bench.suites import decode

        rows = decode.write_csv(doc["cases"], args.csv)
        print(f"wrote {rows} decode rows -> {args.csv}", file=sys.stderr)
    counts = {s: sum(c["status"] == s for c in doc["cases"]) for s in results.STATUSES}
    print(f"bench: {len(doc['cases'])} cases ({', '.join(f'{v} {k}' for k, v in counts.items())}) -> {args.out}",
          file=sys.stderr, flush=True)
    for case in doc["cases"]:
        if case["status"] == "failed":
            print(f"  FAILED {case['id']}: {case['reason']}", file=sys.stderr)
    return exits.FAILED_CASES if args.strict and counts["failed"] else exits.OK


def _run_shards(args: argparse.Namespace, command: str, argv: list[str], gpus: list[str]) -> int:
    """One subprocess per GPU (CUDA_VISIBLE_DEVICES=that GPU), each running `--shard i/N`."""
    with tempfile.TemporaryDirectory(prefix="bench-shards-") as tmp:
        procs = []
        for i, gpu in enumerate(gpus):
            out = str(Path(tmp) / f"shard{i}.json")
            child = [sys.executable, "-m", "bench", *_without(argv, ("--out", "--csv", "--gpus")),
                     "--out", out, "--shard", f"{i}/{len(gpus)}"]
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
            procs.append((gpu, out, subprocess.Popen(child, env=env, cwd=Path(__file__).resolve().parent.parent)))
        docs, failed = [], []
        for gpu, out, proc in procs:
            rc = proc.wait()
            if rc not in (exits.OK, exits.FAILED_CASES) or not Path(out).exists():
                failed.append(f"GPU {gpu} exited {rc}")
            else:
                docs.append(results.load(out))
        if not docs:
            raise RuntimeError(f"every shard failed ({'; '.join(failed)}); see the log above")
        doc = results.merge(docs)
    doc["cases"].sort(key=lambda c: c.get("cell_index", 0))
    doc["run"].update(command=command, shards=len(gpus), gpus=gpus)
    doc["run"].pop("shard", None)
    code = _finish(doc, args)
    if failed:
        print(f"error: {'; '.join(failed)}; their cases are missing from {args.out}", file=sys.stderr)
        return exits.ERROR
    return code


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """`argv` without the given options and their values (`--out x` and `--out=x`)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item in options:
            skip = True
            continue
        if any(item.startswith(o + "=") for o in options):
            continue
        out.append(item)
    return out
