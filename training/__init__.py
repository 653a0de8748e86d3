"""Training under Lightning: run config, LightningModule, callbacks, checkpoints, and `train()`."""

if __name__ != "posgpt.training":  # `import training` from the checkout's root: a second copy of every module
    raise ImportError("this package is posgpt.training: import posgpt.training")
