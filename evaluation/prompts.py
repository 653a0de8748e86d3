"""The prompts of `sample.py`: read, encoded, and cropped to what the model can see. Each mistake stops
with one message that names its prompt (`Prompt.where`): in a file of a hundred, "the prompt" says nothing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from data.errors import DataError
from data.tokenizer import CharTokenizer, Tokenizer

SHOWN_CHARS = 40
"""How much of a prompt a message quotes."""


@dataclass(frozen=True)
class Prompt:
    """One prompt as the user gave it and as the model reads it."""

    where: str
    """How messages name it: `--prompt`, `line 3 of --prompts_file p.txt`."""
    text: str
    ids: list[int]
    """Uncropped: the output shows the whole prompt even where the model sees its end only."""


def prompt_text(prompt: str, prompt_file: str | None = None) -> str:
    """The prompt: `prompt` itself, or the text of `prompt_file` or of @FILE."""
    source = prompt_file or (prompt[1:] if prompt.startswith("@") else None)
    if source is None:
        return prompt
    try:
        return Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"Cannot read the prompt file {source}: {error}") from None


def prompts_file_lines(path: str) -> list[tuple[str, str]]:
    """(where, text) of each line of a `--prompts_file`. An empty line is refused, not skipped: that would
    silently change which output row belongs to which line."""
    option = f"--prompts_file {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{option}: no such file.") from None
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"{option}: cannot read it ({error}).") from None
    lines = text.splitlines()
    if not lines:
        raise DataError(f"{option} is empty: write one prompt per line.")
    empty = [n for n, line in enumerate(lines, 1) if not line]
    if empty:
        raise DataError(f"{option}: line {empty[0]} is empty; write one prompt per line, with no empty lines.")
    return [(f"line {n} of {option}", line) for n, line in enumerate(lines, 1)]


def encode_prompt(tokenizer: Tokenizer, text: str, drop_unknown: bool, where: str = "--prompt") -> list[int]:
    """The tokens of `text`; an empty text is the tokenizer's start token, but one of which `--drop_unknown`
    leaves nothing is refused (the model would continue something the user did not write)."""
    if not text:
        return tokenizer.start_ids()
    try:
        ids = tokenizer.encode(text, drop_unknown) if isinstance(tokenizer, CharTokenizer) else tokenizer.encode(text)
    except DataError as error:
        raise DataError(f"{where}: {error}") from None
    if not ids:
        raise DataError(
            f"{where} ({text[:SHOWN_CHARS]!r}): none of its characters is in the model's vocabulary, so "
            "--drop_unknown leaves nothing to continue; give it characters of the training text."
        )
    return ids


def read_prompts(
    tokenizer: Tokenizer, prompt: str, prompt_file: str | None, prompts_file: str | None, drop_unknown: bool
) -> list[Prompt]:
    """Every prompt of the run, read and encoded, in order."""
    if prompts_file is not None:
        sources = prompts_file_lines(prompts_file)
    else:
        sources = [(f"--prompt_file {prompt_file}" if prompt_file else "--prompt", prompt_text(prompt, prompt_file))]
    return [Prompt(where, text, encode_prompt(tokenizer, text, drop_unknown, where)) for where, text in sources]


def crop(prompts: list[Prompt], max_positions: int | None) -> list[list[int]]:
    """The tokens the model reads of each prompt: the last `max_positions` of a longer one (learned positions
    end there; nanoGPT crops the same way), said in one line on stderr."""
    if max_positions is None:
        return [p.ids for p in prompts]
    long = [p for p in prompts if len(p.ids) > max_positions]
    if long:
        names = ", ".join(p.where for p in long[:3]) + (f" and {len(long) - 3} more" if len(long) > 3 else "")
        tokens = max(len(p.ids) for p in long)
        each = "each continues" if len(long) > 1 else "it continues"
        print(
            f"{names}: {'up to ' if len(long) > 1 else ''}{tokens} tokens, more than the model's {max_positions} "
            f"positions; {each} from its last {max_positions} tokens.",
            file=sys.stderr,
        )
    return [p.ids[-max_positions:] for p in prompts]
