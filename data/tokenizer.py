"""Tokenizers: `char` (vocabulary built from the corpus) and `gpt2` (tiktoken's GPT-2 BPE), rebuilt from the
`tokenizer` block of `meta.json` that every checkpoint saves too (`meta()`). `end_id` is the token that ends a
document (GPT-2's <|endoftext|>; None at char level), `start_ids()` what an empty prompt starts from.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from itertools import groupby
from pathlib import Path
from typing import Any

import numpy as np

from posgpt.data.errors import DataError

RANKS_ENV = "POSGPT_TIKTOKEN_RANKS"  # a local GPT-2 ranks file (`r50k_base.tiktoken`), for offline BPE
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_VOCAB = 50257
EOT = "<|endoftext|>"


class CharTokenizer:
    """One id per distinct character of the corpus, in sorted order (as nanoGPT's shakespeare_char)."""

    end_id: int | None = None

    def __init__(self, chars: Iterable[str]) -> None:
        self.chars = sorted(set(chars))
        if not self.chars:
            raise DataError("A char tokenizer needs at least one character; the corpus is empty.")
        self.vocab_size = len(self.chars)
        self._ids = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str, drop_unknown: bool = False) -> list[int]:
        """Ids of `text`; characters outside the vocabulary are an error naming them, or left out."""
        unknown = sorted(set(text) - self._ids.keys())
        if unknown and not drop_unknown:
            raise DataError(
                f"Characters not in the vocabulary: {''.join(unknown)!r} ({len(unknown)} distinct). "
                "A char-level model only knows the characters of its training corpus; remove them "
                "(sample.py: --drop_unknown true)."
            )
        return [self._ids[c] for c in (filter(self._ids.__contains__, text) if unknown else text)]

    def encode_pieces(self, texts: list[str], ends: list[bool], num_threads: int = 1) -> np.ndarray:
        """The ids of `texts` in order, a newline after those that end a document."""
        text = "".join(text + "\n" * end for text, end in zip(texts, ends, strict=True))
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self.decode(ids).encode()

    def start_ids(self) -> list[int]:
        """A newline, where the corpus has one (the start of a line), else the first character."""
        return [self._ids.get("\n", 0)]

    def meta(self) -> dict[str, Any]:
        return {"kind": "char", "vocab_size": self.vocab_size, "chars": "".join(self.chars)}


class GPT2Tokenizer:
    """GPT-2's byte-level BPE (tiktoken's `gpt2`), from a local ranks file where one is given (its sha256
    checked), else from tiktoken's cache or the internet."""

    def __init__(self, ranks_path: str | os.PathLike | None = None) -> None:
        import tiktoken

        ranks_path = ranks_path or os.environ.get(RANKS_ENV) or None
        if ranks_path is None:
            try:
                self._enc = tiktoken.get_encoding("gpt2")
            except Exception as error:  # no cache and no network: tiktoken raises requests errors
                raise DataError(
                    "Could not load tiktoken's GPT-2 encoding (no cached copy and no network?). Pass "
                    f"a local r50k_base.tiktoken ranks file with --data.tiktoken_ranks PATH or {RANKS_ENV}."
                ) from error
        else:
            from tiktoken.load import load_tiktoken_bpe
            from tiktoken_ext.openai_public import r50k_pat_str

            path = Path(ranks_path)
            if not path.is_file():
                raise DataError(f"GPT-2 ranks file not found: {path} (expected r50k_base.tiktoken).")
            try:
                ranks = load_tiktoken_bpe(str(path), expected_hash=R50K_SHA256)
            except ValueError as error:
                raise DataError(
                    f"{path} is not tiktoken's r50k_base ranks file (sha256 {R50K_SHA256[:8]}...): {error}"
                ) from None
            self._enc = tiktoken.Encoding(
                name="gpt2",
                explicit_n_vocab=GPT2_VOCAB,
                pat_str=r50k_pat_str,
                mergeable_ranks=ranks,
                special_tokens={EOT: GPT2_VOCAB - 1},
            )
        self.vocab_size = GPT2_VOCAB
        self.end_id: int = self._enc.eot_token

    def encode(self, text: str, drop_unknown: bool = False) -> list[int]:
        """Ids of `text`; `drop_unknown` as `CharTokenizer.encode`'s, where nothing is unknown (bytes)."""
        return self._enc.encode_ordinary(text)

    def encode_pieces(self, texts: list[str], ends: list[bool], num_threads: int = 1) -> np.ndarray:
        """The ids of `texts` in order, each encoded on its own, with <|endoftext|> after those that end a
        document (`ends`), on `num_threads` threads.

        One call per short text would spend the threads' time handing the GIL over, so each thread encodes a
        contiguous group of texts in one call, joined by <|endoftext|> with that token allowed: tiktoken
        encodes the text between special tokens alone, so each text's ids are exactly `encode(text)`. A text
        that itself holds the string <|endoftext|> is encoded on its own, as the plain text it is."""
        lengths, n = [len(text) for text in texts], max(num_threads, 1)  # n groups of about equal total length
        cuts = np.searchsorted(np.cumsum(lengths), np.arange(1, n) * sum(lengths) / n) + 1
        bounds = sorted({0, len(texts), *np.minimum(cuts, len(texts)).tolist()})
        if len(bounds) <= 2:
            return self._encode_group(texts, ends)
        jobs = [(texts[lo:hi], ends[lo:hi]) for lo, hi in zip(bounds, bounds[1:], strict=False)]
        with ThreadPoolExecutor(len(jobs)) as executor:
            return np.concatenate(list(executor.map(lambda job: self._encode_group(*job), jobs)))

    def _encode_group(self, texts: list[str], ends: list[bool]) -> np.ndarray:
        """`encode_pieces` of one thread: runs of texts in one call each, a text holding <|endoftext|> alone."""
        parts: list[np.ndarray] = []
        for special, run in groupby(zip(texts, ends, strict=True), key=lambda item: EOT in item[0]):
            if special:
                parts += [np.asarray(self.encode(text) + [self.end_id] * end, dtype=np.int64) for text, end in run]
            else:
                texts_run, ends_run = zip(*run, strict=True)
                ids = np.asarray(self._enc.encode(EOT.join(texts_run) + EOT, allowed_special={EOT}), dtype=np.int64)
                separators = np.flatnonzero(ids == self.end_id)  # one after each text
                parts.append(np.delete(ids, separators[~np.asarray(ends_run, dtype=bool)]))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode(list(ids))

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self._enc.decode_bytes(list(ids))

    def start_ids(self) -> list[int]:
        """<|endoftext|>, which separates documents in GPT-2's training data."""
        return [self.end_id]

    def meta(self) -> dict[str, Any]:
        return {"kind": "gpt2", "vocab_size": self.vocab_size}


Tokenizer = CharTokenizer | GPT2Tokenizer


def tokenizer_from_meta(meta: dict[str, Any], ranks_path: str | None = None) -> Tokenizer:
    """Rebuild the tokenizer that `meta()` described."""
    if meta.get("kind") == "char":
        return CharTokenizer(meta["chars"])
    if meta.get("kind") == "gpt2":
        return GPT2Tokenizer(ranks_path)
    raise ValueError(f"Unknown tokenizer description {meta!r}; expected kind 'char' or 'gpt2'.")
