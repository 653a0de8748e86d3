"""The corpus pipeline: text -> token files (`prepare`), token files -> windows (`dataset`), and the synthetic tasks."""
