"""One way to run every command: its options are one dataclass (nested ones become dotted groups, field
docstrings the --help text) read by jsonargparse; a mistake the user can fix ends in one line and exit
status 2 (a refused option: a short usage with "did you mean"), Ctrl+C in "Interrupted." and 130."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import re
import sys
import types
import typing
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, Generic, TypeVar

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, get_loader, set_parsing_settings

from posgpt import configs
from posgpt.core.errors import ConfigError, UserError, did_you_mean
from posgpt.core.threads import FreeCores

C = TypeVar("C")

BUILTIN_OPTIONS = ("config", "print_config", "help")
MAX_ERROR_LINES = 8  # of a parser's message under the usage line (with the hint: at most 10 in all)


@dataclass(frozen=True)
class Command(Generic[C]):
    """A command line: its options (one dataclass) and what it does with them."""

    prog: str  # the name in the usage line
    config: type[C]  # the options
    main: Callable[[C], object]
    description: str = ""  # the text at the top of --help
    default_config: str | None = None  # a YAML file read before the command line (train.py's default run)
    hidden: frozenset[str] = frozenset()  # dotted fields accepted but not in --help (older config files hold them)
    aliases: Mapping[str, str] = field(default_factory=dict)
    """How this command spells options that shared code names in its messages: {prefix there: prefix here}."""
    logs: bool = True  # show the project's INFO logs on stderr
    hints: Mapping[str, str] = field(default_factory=dict)
    """{text in the parser's message: a sentence to add}: the fix of a refusal the parser cannot explain."""


class UsageError(UserError):
    """An option or value the parser refuses: a short usage, the problem and where the options are listed."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog

    def line(self) -> str:
        return f"usage: {self.prog} [options]\nerror: {self}\nRun '{self.prog} --help' for the options."


def run(command: Command[C], argv: Sequence[str] | None = None) -> None:
    """Parse `argv` (default: the process' arguments), validate, run; end a user's mistake in one line."""
    try:
        config = parse(command, argv)
        if command.logs:
            logging.basicConfig(level=logging.INFO, format="%(message)s")
        with quiet_libraries(), FreeCores():
            command.main(config)
    except UserError as error:  # a UsageError names this command's options as the user typed them
        print(error.line() if isinstance(error, UsageError) else spell(error.line(), command), file=sys.stderr)
        sys.exit(error.exit_code)
    except KeyboardInterrupt:  # nothing half-written is kept (files are written atomically)
        print("Interrupted.", file=sys.stderr)
        sys.exit(130)


def parse(command: Command[C], argv: Sequence[str] | None = None) -> C:
    """The command's validated options; raises `UsageError` or `ConfigError` (the config's own checks)."""
    argv = shipped_configs(list(sys.argv[1:] if argv is None else argv), command)
    parser = build_parser(command)
    try:
        args = spread_lists(argv, sequence_options(command), bool_options(command))
        namespace = parser.parse_args(merged_fields(parser, args, command))
    except argparse.ArgumentError as error:
        message = usage_message(str(error), options(command))
        for text, hint in command.hints.items():
            message = f"{message.rstrip('.')}. {hint}" if text in str(error) else message
        raise UsageError(command.prog, message) from None
    try:
        values = parser.instantiate(namespace)
        return command.config(**{f.name: values[f.name] for f in dataclasses.fields(command.config) if f.init})
    except UserError:  # a check that raises a user error of its own kind (a DeviceError, say)
        raise
    except ValueError as error:  # a __post_init__ check: it names the setting and the fix
        raise ConfigError(str(error)) from None


def merged_fields(parser: ArgumentParser, args: list[str], command: Command) -> list[str]:
    """`args` with each override of one field of a mapping option's entry (model.kinds.global.rope_base) as one
    override of the entry: the field set, the rest as the files and options before gave it (jsonargparse alone
    would replace the entry by that one field, dropping the others)."""
    maps = [f"--{n}." for n, kind, _ in _offered(command) if any(typing.get_origin(m) is dict for m in _members(kind))]
    rest, fields, tokens = [], {}, list(args)
    while tokens:
        name, eq, value = (token := tokens.pop(0)).partition("=")
        option = next((m for m in maps if name.startswith(m) and "." in name[len(m) :]), None)
        if option is None or not (eq or tokens and not tokens[0].startswith("--")):  # no value: the parser says so
            rest.append(token)
            continue
        key, field = name[len(option) :].split(".", 1)
        fields.setdefault((option, key), {})[field] = get_loader(parser.parser_mode)(value if eq else tokens.pop(0))
    if fields:  # the entries as the rest gives them: one more parse
        before = parser.parse_args([t for t in rest if not t.startswith(("--print_config", "--help")) and t != "-h"])
        rest += [
            f"{o}{k}={json.dumps({**((before[o[2:-1]] or {}).get(k) or {}), **v})}" for (o, k), v in fields.items()
        ]
    return rest


def shipped_configs(argv: list[str], command: Command) -> list[str]:
    """`argv` with every `--config configs/NAME.yaml` that is not a file here read from the shipped configs; a config
    file that is not a mapping is refused in one line (what is not a YAML file is left to jsonargparse)."""
    out = []
    for before, token in pairwise(["", *argv]):
        inline = token.startswith("--config=")
        path = token.removeprefix("--config=") if inline or before == "--config" else None
        if path and not Path(path).exists() and Path(path).parent.name == "configs":  # none here: a shipped one?
            shipped = configs.shipped(Path(path).name)
            path = str(shipped) if shipped.is_file() else path
        out.append(f"--config={path}" if inline else path or token)
        try:
            content = yaml.safe_load(Path(path).read_text(encoding="utf-8")) if path and Path(path).is_file() else {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        if not isinstance(content, dict):
            what = {type(None): "nothing", list: "a list"}.get(type(content), f"a single value ({content!r})")
            names = [f"{name}:" for name, _, group in _offered(command) if "." not in name]
            raise UsageError(
                command.prog,
                f"--config {path} holds {what}, not a mapping: a config file maps this command's sections and "
                f"options to their values ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); "
                f"`{command.prog} --print_config` writes one.",
            )
    return out


def build_parser(command: Command) -> ArgumentParser:
    """jsonargparse over the command's dataclass, group by group (so that `hidden` reaches nested fields)."""
    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # field docstrings become --help text
    parser = ArgumentParser(
        prog=command.prog,
        usage=f"{command.prog} [--config FILE.yaml] [--print_config] [--GROUP.OPTION VALUE ...]",
        description=command.description,
        exit_on_error=False,
        allow_abbrev=False,  # a prefix of an option is a typo to point out, not an option
        default_config_files=[command.default_config] if command.default_config else None,
    )
    parser.add_argument(
        "--config",
        action=ActionConfigFile,
        help="A YAML file of these options (--print_config writes one); configs/NAME.yaml is read from the "
        "shipped configs where no such file is here.",
    )
    _add_group(parser, command.config, "", None, command)
    return parser


def _add_group(parser: ArgumentParser, cls: type, prefix: str, defaults: Any, command: Command) -> None:
    """The fields of dataclass `cls` under `prefix`; `defaults`: the instance its parent gives (RunConfig's model)."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    nested = {f.name for f in fields if dataclasses.is_dataclass(hints[f.name])}
    left_out = {f.name for f in fields if prefix + f.name in command.hidden}
    values = None if defaults is None else {f.name: getattr(defaults, f.name) for f in fields}  # those hidden: unused
    parser.add_class_arguments(cls, prefix[:-1] or None, default=values, skip=nested | left_out)
    group = parser.groups.get(prefix[:-1] or cls.__name__)
    if group is not None and group.title:  # the summary line: the defaults shown are the command's, not the class'
        group.title = group.title.split(". ")[0].rstrip(".")
    for f in fields:
        if f.name in nested:
            default = getattr(defaults, f.name) if defaults is not None else f.default_factory()  # a nested group's
            _add_group(parser, hints[f.name], f"{prefix}{f.name}.", default, command)
        elif prefix + f.name in command.hidden:
            parser.add_argument(
                f"--{prefix}{f.name}", type=hints[f.name], default=argparse.SUPPRESS, help=argparse.SUPPRESS
            )


def _offered(command: Command, cls: type | None = None, prefix: str = "") -> Iterator[tuple[str, Any, bool]]:
    """(dotted name, type, is a group) of every option the command offers, groups before their fields."""
    hints = typing.get_type_hints(cls or command.config)
    for f in dataclasses.fields(cls or command.config):
        name, kind = prefix + f.name, hints[f.name]
        if f.init and name not in command.hidden:
            yield name, kind, dataclasses.is_dataclass(kind)
            if dataclasses.is_dataclass(kind):
                yield from _offered(command, kind, name + ".")


def options(command: Command) -> list[str]:
    """The options --help lists, dotted, without dashes: the built-in ones and the fields (groups too)."""
    return [*BUILTIN_OPTIONS, *(name for name, _, _ in _offered(command))]


def sequence_options(command: Command) -> dict[str, Any]:
    """{dotted name: type} of the command's list and tuple options."""
    return {name: kind for name, kind, group in _offered(command) if not group and _sequence(kind)}


def bool_options(command: Command) -> set[str]:
    """The dotted names of the command's bool options (`bool | None` too)."""
    return {name for name, kind, group in _offered(command) if not group and bool in _members(kind)}


def _members(kind: Any) -> tuple[Any, ...]:
    return typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else (kind,)


def _sequence(kind: Any) -> Any:
    """The list or tuple type among those `kind` admits (the first), or None."""
    return next((m for m in _members(kind) if (typing.get_origin(m) or m) in (list, tuple)), None)


TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "text", "NoneType": "null"}
TYPE_WORDS |= dict.fromkeys(("list", "tuple"), "a list ([a, b])")
"""How a value of a plain type is named in a message about a wrong one."""


def usage_message(message: str, names: Sequence[str]) -> str:
    """jsonargparse's message in a few lines, with the closest option to an unknown one."""
    # 'Expected a <class 'int'>. Got value: abc' (or a union's list of them) as one line naming the option and the
    # type: '--train.max_steps takes an integer, got 'abc''
    key = re.match(r'Parser key "([\w.]+)":', message)
    expected = re.findall(r"Expected a <class '(\w+)'>", message)
    value = re.search(r"(?:Got|Given) value: (.*)", message)
    if key and value and expected and all(t in TYPE_WORDS for t in expected):
        return f"--{key[1]} takes {' or '.join(TYPE_WORDS[t] for t in expected)}, got {value[1].strip()!r}"
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):  # 'Parser key "x":' + the problem
        lines[:2] = [f"{lines[0]} {lines[1]}"]
    if len(lines) > MAX_ERROR_LINES:
        lines = [*lines[: MAX_ERROR_LINES - 1], "..."]
    text = "\n".join(lines)
    if text.startswith("the following arguments are required: "):  # argparse names them without dashes
        head, _, missing = text.partition(": ")
        text = f"{head}: " + ", ".join("--" + name.strip() for name in missing.split(","))
    unknown = re.findall(r"(?<![\w-])--([\w.]+)", message) if "unrecognized arguments" in message else []
    unknown += [".".join(pair) for pair in re.findall(r"Group '([\w.]+)' does not accept option '([\w.]+)'", message)]
    for name in unknown + re.findall(r"^Option '([\w.]+)' is not accepted", message):  # command line, config file
        if hint := did_you_mean(name, names, "--"):
            return text + hint
    return text


OPTION = re.compile(r"(?<![\w-])--([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")


def spell(text: str, command: Command) -> str:
    """`text` with every option spelled as this command takes it (`--device` is `--eval.device` in evaluate.py): as
    written if the command takes it, else as `command.aliases` rename it, else the one option ending in `.name`."""
    known = {*options(command), *command.hidden}  # the options it takes, those hidden from --help too

    def spelled(match: re.Match[str]) -> str:
        name = match.group(1)
        renamed = [here + name[len(there) :] for there, here in command.aliases.items() if name.startswith(there)]
        tail = [option for option in known if option.endswith("." + name)]
        found = [n for n in (name, *renamed) if n in known] or (tail if len(tail) == 1 else [name])
        return "--" + found[0]

    return OPTION.sub(spelled, text)


def spread_lists(argv: Sequence[str], sequences: Mapping[str, Any], flags: Collection[str] = ()) -> list[str]:
    """`argv` with every `--x a b c` of a list option as jsonargparse reads it: `--x=[] --x+=a ...` (each value
    parsed on its own), `--x=[a,b,c]` for a tuple; `--x [a,b,c]` and a single value that may be one pass through.
    A bool option of `flags` written alone (`--quick`, the next token another option or none) as `--quick=true`;
    `--quick false` and `--quick=false` as they are (jsonargparse gives a bool one value, always)."""
    out: list[str] = []
    tokens = list(argv)
    while tokens:
        token = tokens.pop(0)
        name, eq, inline = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        if name not in sequences:
            bare = name in flags and not eq and (not tokens or tokens[0].startswith("-"))
            out.append(f"{token}=true" if bare else token)
            continue
        values = [inline] if eq else []
        while tokens and not (tokens[0].startswith("--") or (tokens[0][:1] == "-" and tokens[0][1:2].isalpha())):
            values.append(tokens.pop(0))
        out += _sequence_args(name, values, sequences[name])
    return out


def _sequence_args(name: str, values: list[str], kind: Any) -> list[str]:
    if not values:
        return [f"--{name}"]  # the parser says that a value is missing
    sequence = _sequence(kind)
    items = typing.get_args(sequence)
    nested = typing.get_origin(sequence) is list and bool(items) and typing.get_origin(items[0]) in (list, tuple)
    single_ok = any(m is not type(None) and _sequence(m) is None for m in _members(kind))  # `str | list[str]`
    whole = values[0].startswith("[[" if nested else "[") or values[0] == "null"
    if len(values) == 1 and (single_ok or whole):
        return [f"--{name}={values[0]}"]  # `=`: a value that starts with a dash stays a value
    if (typing.get_origin(sequence) or sequence) is tuple:
        return [f"--{name}=[{','.join(values)}]"]
    if nested:  # each item is a tuple, written 4,128,64,12 as a tuple option takes it
        values = [v if v.startswith("[") else f"[{v}]" for v in values]
    return [f"--{name}=[]", *(f"--{name}+=[{v}]" if v.startswith("[") else f"--{name}+={v}" for v in values)]


LIBRARY_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")  # devices available, AMP in use, ...


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Leave out Lightning's notices (its warnings stay) and libraries' deprecation warnings about each other."""
    levels = {logger: logger.level for logger in map(logging.getLogger, LIBRARY_LOGGERS)}
    for logger in levels:
        logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            for category in (DeprecationWarning, FutureWarning):
                warnings.filterwarnings("ignore", category=category, module=r"(lightning|torch|lightning_utilities)\.")
            yield
    finally:
        for logger, level in levels.items():
            logger.setLevel(level)
