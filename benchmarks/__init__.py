"""Benchmark scripts (run them as files: python benchmarks/NAME.py); importable for their tests."""
