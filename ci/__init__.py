"""The CPU side of the benchmark pipeline: decide, report, threshold PR.

Reads results files only; never imports torch (`docs/pipeline.md`).
"""
