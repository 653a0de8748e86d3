"""The corpus pipeline: text -> token files (`prepare`), token files -> batches (`dataset`, `datamodule`)."""
