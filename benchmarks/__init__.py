"""Benchmark modes that `bench.py` runs, by area."""

if __name__ != "posgpt.benchmarks":  # `import benchmarks` from the checkout's root: a second copy of every module
    raise ImportError("this package is posgpt.benchmarks: import posgpt.benchmarks")
