"""Benchmarks of the alignopsd engine (pytest-benchmark files, the step profiler, results)."""
