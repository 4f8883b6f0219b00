"""The contract between the NSA library, the benchmark and the pipeline: torch-free, at the bottom.

What `nsa` (the library), `bench` (timing, suites) and `ci` (decide, history, report, PR) must
agree on lives here, once: the decision keys (`keys`), the config loader (`settings`) and where
the default files are (`resources`), the results schema (`results`), the decision document
(`decision`), threshold values (`values`), the suite lists (`suites`), the exit codes (`exits`),
path checks (`paths`) and atomic writes (`atomic`).

Direction (DESIGN.md; enforced by tests/test_layers.py): `nsa` -> contract; `bench` -> `nsa` +
contract; `ci` -> contract only. This package imports none of them, nor torch: the GPU
workflow's decide job runs `python -m ci` on it without torch installed. Standard library and
PyYAML (`settings`) only. The modules are imported by name (`from nsa_contract import keys`);
this file imports nothing, so each costs only what it uses.
"""
