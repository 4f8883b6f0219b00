"""Benchmark harness and suites. Importing this package never imports torch or touches CUDA."""
