"""Benchmarks run from the command line (`python -m dpbench.tools.benchmarks.<name>`), not in tests."""
