"""posgpt: a small decoder-only GPT trainer for positional-encoding research. The `posgpt` command
(posgpt/cli.py) runs every tool: train, sample, evaluate, attention, prepare, plot, study, bench."""
