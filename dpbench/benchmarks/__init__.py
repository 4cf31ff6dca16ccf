"""Benchmarks run from the command line (`python -m dpbench.benchmarks.<name>`), not in tests."""
