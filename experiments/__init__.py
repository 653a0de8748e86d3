"""Experiments that combine training and evaluation: `posgpt study NAME --config ...`."""
