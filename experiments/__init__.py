"""Experiments that combine training and evaluation: `posgpt study NAME --config ...`."""

if __name__ != "posgpt.experiments":  # `import experiments` from the checkout's root: a second copy of every module
    raise ImportError("this package is posgpt.experiments: import posgpt.experiments")
