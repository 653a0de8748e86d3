"""List options on the command line: `--x a b c` as well as jsonargparse's `--x [a,b,c]`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ListOption:
    """How a list or tuple option is written."""

    kind: type  # list or tuple
    single_ok: bool  # a single plain value is accepted too (`str | list[str]`)
    nested: bool  # its items are lists or tuples themselves (`list[tuple[int, int]]`): `[1,2]` is one item


def spread_lists(argv: Sequence[str], sequences: Mapping[str, ListOption]) -> list[str]:
    """`argv` with every `--x a b c` of a list option as jsonargparse reads it: `--x=[] --x+=a ...` (each value
    parsed on its own), `--x=[a,b,c]` for a tuple; `--x [a,b,c]` and a single value that may be one pass through."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        name, eq, inline = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        if name not in sequences:
            out.append(token)
            continue
        values = [inline] if eq else []
        while i < len(argv) and not (argv[i].startswith("--") or (argv[i][:1] == "-" and argv[i][1:2].isalpha())):
            values.append(argv[i])
            i += 1
        out += _sequence_args(name, values, sequences[name])
    return out


def _sequence_args(name: str, values: list[str], sequence: ListOption) -> list[str]:
    if not values:
        return [f"--{name}"]  # the parser says that a value is missing
    whole = values[0].startswith("[[" if sequence.nested else "[") or values[0] == "null"
    if len(values) == 1 and (sequence.single_ok or whole):
        return [f"--{name}={values[0]}"]  # `=`: a value that starts with a dash stays a value
    if sequence.kind is tuple:
        return [f"--{name}=[{','.join(values)}]"]
    if sequence.nested:  # each item is a tuple, written 4,128,64,12 as a tuple option takes it
        values = [v if v.startswith("[") else f"[{v}]" for v in values]
    return [f"--{name}=[]", *(f"--{name}+=[{v}]" if v.startswith("[") else f"--{name}+={v}" for v in values)]
