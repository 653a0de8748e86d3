"""What every part of the project shares and none owns: files, checkpoints, devices, the command line."""

if __name__ != "posgpt.core":  # `import core` from the checkout's root: a second copy of every module
    raise ImportError("this package is posgpt.core: import posgpt.core")
