"""The `python -m ci` subcommands' own argument checks: `--margin` and NSA_PR_DRY_RUN.

The path checks every command shares (`bench` too) are `nsa_contract.paths`; these two are the
pipeline's alone. Each refuses a value in one line that says how to fix it, before a stage reads
or writes. Standard library only.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping

from nsa_contract.paths import InputError

__all__ = ["DRY_RUN_ENV", "env_dry_run", "parse_margin"]

DRY_RUN_ENV = "NSA_PR_DRY_RUN"
_TRUE, _FALSE = ("1", "true", "yes"), ("", "0", "false", "no")


def env_dry_run(env: Mapping[str, str], error: type[Exception] = InputError) -> bool:
    """NSA_PR_DRY_RUN: how a workflow's boolean input asks for a dry run (empty when unset, as on a
    schedule); anything else raises `error` (each stage's own bad-input type)."""
    value = env.get(DRY_RUN_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise error(f"{DRY_RUN_ENV} must be true or false (or empty), got {env[DRY_RUN_ENV]!r}; "
                "pass the workflow's boolean input as is")


def parse_margin(text: str) -> float | None:
    """A `--margin` value: a finite number > 0, or empty for the config's decide.margin.

    Empty is what an unset workflow input expands to (a scheduled run has no inputs), so the
    workflow can always pass `--margin "$MARGIN"`. NaN would make every comparison false and
    infinity could never be cleared, so both are refused here rather than deciding nothing.
    """
    if not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"--margin must be a finite number above 0, got {text!r}; pass e.g. --margin 1.2, or an empty "
            "value for the config's decide.margin")
    return value
