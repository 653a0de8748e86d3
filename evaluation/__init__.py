"""Length-extrapolation evaluation: loss and perplexity of a model against context length."""

if __name__ != "posgpt.evaluation":  # `import evaluation` from the checkout's root: a second copy of every module
    raise ImportError("this package is posgpt.evaluation: import posgpt.evaluation")
