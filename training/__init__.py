"""Training under Lightning: run config, LightningModule, callbacks, checkpoints, and `train()`."""
