"""The suite lists the benchmark and the pipeline share: which suites a sweep runs by default.

Written once here; `python -m bench run` (its default `--suites` and the set names it accepts),
`python -m ci pipeline` (its sweep) and the GPU workflow (`--suites nightly`) all read them. The
suites themselves (their cells, as data) are `bench/suites/<name>.py`; a name here that is not one
of them fails tests/bench/test_suites.py.
"""

from __future__ import annotations

from nsa_contract import keys

CALIBRATION = "calibration"  # A/A replicas of one case: the noise floor (`ci.noise`)
AUTO = "auto"  # `auto` against every plan of one call (`ci.autobest`), never against masked SDPA
# The suites whose cells decide some key (each key names its suite: fa2, triton), plus the noise
# floor. Derived from the keys, so a key with a suite of its own joins the default sweep.
DEFAULT: tuple[str, ...] = (*sorted(keys.suites()), CALIBRATION)
# Added for a nightly or full sweep on CUDA: auto against every plan, the fast path at the paper
# layout, decode steps, training steps and the ragged paged decode cell of `serve` (its nightly
# size is that one cell, with its trend). A CPU smoke run keeps to DEFAULT.
GPU: tuple[str, ...] = (AUTO, "fast", "decode", "train", "serve")
NIGHTLY: tuple[str, ...] = (*DEFAULT, *GPU)
# Every other suite bench has runs only when named (or with `all`): masked, prefill and serve_prefill
# (packed and chunked prefill), which decide no key and are not in the nightly sweep.

# Names `--suites` takes for a whole list (bench also takes `all`: every suite it has).
SETS: dict[str, tuple[str, ...]] = {"default": DEFAULT, "nightly": NIGHTLY}


def joined(names: tuple[str, ...]) -> str:
    """`fa2,triton,calibration`: a list as `--suites` takes it."""
    return ",".join(names)
