"""Experiments that combine training and evaluation: `python -m experiments.<name> --config ...`."""
