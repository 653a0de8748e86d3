"""The corpus pipeline: text -> token files (`prepare`), token files -> windows (`dataset`), and the synthetic tasks."""

if __name__ != "posgpt.data":  # `import data` from the checkout's root: a second copy of every module
    raise ImportError("this package is posgpt.data: import posgpt.data")
