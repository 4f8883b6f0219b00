"""The exit codes of `python -m bench` and every `python -m ci` subcommand: one table, one meaning each.

A workflow step, `ci pipeline` and `make` read a command's outcome from its code alone, so a code
means the same in every command. A command may use fewer of them; none uses another number.
"""

from __future__ import annotations

OK = 0
ERROR = 1  # the command could not finish: a sweep that broke, GitHub unreachable or refusing
BAD_INPUT = 2  # bad usage, a bad file or path, a file-system fault (one line with the cause and the fix)
FAILED_CASES = 3  # measured cases failed: parity (`ci decide`, which still writes its file), `bench run --strict`
REGRESSION = 4  # `ci history` / `ci pipeline`: a case is slower than in its GPU model's history (all written first)

MEANING = {
    OK: "ok",
    ERROR: "could not finish (the message says why)",
    BAD_INPUT: "bad input: a flag, file or path that cannot work, or a file-system fault",
    FAILED_CASES: "cases failed (parity, or an exception under --strict)",
    REGRESSION: "a regression against this GPU model's history",
}
