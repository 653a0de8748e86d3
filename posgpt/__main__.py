"""`python -m posgpt ...`: the same as the `posgpt` command."""

from posgpt.cli import main

main()
