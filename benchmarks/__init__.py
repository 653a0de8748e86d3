"""Benchmark modes that `bench.py` runs, by area."""
