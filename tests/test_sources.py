"""Corpus sources: a directory of text, JSON lines (plain and gzipped), Parquet, a dataset saved with `datasets`
and a Hub dataset (through a monkeypatched loader: no network) each prepare into exactly the expected token
stream, with what they are recorded; each bad source is one clear message; a JSON-lines corpus trains."""

from __future__ import annotations

import gzip
import json
import logging
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from posgpt.core import cli
from posgpt.data import prepare as prepare_module
from posgpt.data.dataset import load_prepared, prepare_dir, recorded_data
from posgpt.data.errors import DataError
from posgpt.data.prepare import fingerprint, prepare, resolve_sources
from posgpt.data.sources import HubSpec
from posgpt.data.tokenizer import GPT2Tokenizer

DOCS = ["The king speaks of the crown.", "A fool loves the sea.\nSecond line.", "Ünïcödé ✓ — text", "last one\n"]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _tokens(out: Path) -> list[int]:
    """Every token of a prepared directory, train then val (which may be empty)."""
    data = load_prepared(out)
    return np.concatenate([np.fromfile(out / f"{split}.bin", data.dtype) for split in ("train", "val")]).tolist()


def _bpe_stream(tok: GPT2Tokenizer, docs: list[str]) -> list[int]:
    """What a corpus of `docs` must become: each document's ids, then <|endoftext|>."""
    return [i for doc in docs for i in [*tok.encode(doc), tok.end_id]]


def _jsonl(path: Path, rows: list, opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path


def write_jsonl(tmp: Path) -> Path:
    rows = [{"id": i, "text": doc} for i, doc in enumerate(DOCS)]
    rows.insert(2, {"id": 9, "text": None})  # a null text is skipped
    path = _jsonl(tmp / "docs.jsonl", rows)
    path.write_text(path.read_text() + "\n")  # a blank line too
    return path


def write_jsonl_gz(tmp: Path) -> Path:
    return _jsonl(tmp / "docs.jsonl.gz", [{"text": doc} for doc in DOCS], gzip.open)


def write_parquet(tmp: Path) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"n": list(range(len(DOCS))), "text": DOCS})
    pq.write_table(table, tmp / "docs.parquet", row_group_size=3)  # two row groups, read in order
    return tmp / "docs.parquet"


def write_saved_dataset(tmp: Path) -> Path:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": DOCS, "n": list(range(len(DOCS)))}).save_to_disk(str(tmp / "saved"))
    return tmp / "saved"


WRITERS = {"jsonl": write_jsonl, "jsonl.gz": write_jsonl_gz, "parquet": write_parquet, "saved": write_saved_dataset}
FORMATS = {"jsonl": "jsonl", "jsonl.gz": "jsonl", "parquet": "parquet", "saved": "saved-dataset"}


@pytest.mark.parametrize("kind", list(WRITERS))
def test_each_source_of_documents_is_its_documents_each_ended_by_endoftext(kind, tmp_path, gpt2_ranks):
    source = WRITERS[kind](tmp_path)
    meta = prepare(str(source), str(tmp_path / "out"), "gpt2", tiktoken_ranks=str(gpt2_ranks), workers=2)
    tok = GPT2Tokenizer(gpt2_ranks)
    assert _tokens(tmp_path / "out") == _bpe_stream(tok, DOCS)
    (detail,) = meta["source_details"]
    assert detail == {"source": str(source.resolve()), "format": FORMATS[kind], "column": "text"}
    assert load_prepared(tmp_path / "out").record()["source_details"] == [detail]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_char_mode_ends_each_document_with_a_newline(kind, tmp_path):
    source = WRITERS[kind](tmp_path)
    prepare(str(source), str(tmp_path / "out"), "char", val_fraction=0.0)
    tok = load_prepared(tmp_path / "out").tokenizer()
    assert tok.decode(_tokens(tmp_path / "out")) == "".join(doc + "\n" for doc in DOCS)


def test_a_directory_keeps_file_order_and_reads_each_file_by_its_suffix(tmp_path, gpt2_ranks):
    root = tmp_path / "corpus"
    (root / "b").mkdir(parents=True)
    (root / "a.txt").write_text("first file\n")
    (root / "b" / "c.txt").write_text("second file\n")
    _jsonl(root / "b" / "d.jsonl", [{"text": "a json document"}])
    tok = GPT2Tokenizer(gpt2_ranks)
    prepare(str(root), str(tmp_path / "txt"), "gpt2", tiktoken_ranks=str(gpt2_ranks))
    assert _tokens(tmp_path / "txt") == _bpe_stream(tok, ["first file\n", "second file\n"])
    prepare(str(root), str(tmp_path / "all"), "gpt2", glob="*.*", tiktoken_ranks=str(gpt2_ranks))
    assert _tokens(tmp_path / "all") == _bpe_stream(tok, ["first file\n", "second file\n", "a json document"])
    formats = [d["format"] for d in load_prepared(tmp_path / "all").meta["source_details"]]
    assert formats == ["text", "text", "jsonl"]


def test_another_text_column_is_read_and_keyed(tmp_path):
    path = _jsonl(tmp_path / "rows.jsonl", [{"body": doc, "text": "not this"} for doc in DOCS])
    default = prepare_dir(str(path), None, str(tmp_path / "p"), val_fraction=0.0)
    body = prepare_dir(str(path), None, str(tmp_path / "p"), val_fraction=0.0, text_column="body")
    assert default.path != body.path and default.meta["fingerprint"] != body.meta["fingerprint"]
    assert body.tokenizer().decode(_tokens(body.path)) == "".join(doc + "\n" for doc in DOCS)
    cli.run(prepare_module.COMMAND, ["--inputs", str(path), "--out_dir", str(tmp_path / "cli"), "--text_column",
                                     "body", "--val_fraction", "0"])  # fmt: skip
    assert load_prepared(tmp_path / "cli").meta["fingerprint"] == body.meta["fingerprint"]


@pytest.fixture
def hub(monkeypatch) -> SimpleNamespace:
    """The Hub, monkeypatched: `dataset_info` gives COMMIT, `load_dataset` streams DOCS; calls are recorded."""
    datasets = pytest.importorskip("datasets")
    huggingface_hub = pytest.importorskip("huggingface_hub")
    calls = SimpleNamespace(info=[], load=[], rows=[{"text": doc, "meta": 1} for doc in DOCS])

    def dataset_info(self, repo_id, revision=None, **kwargs):
        calls.info.append((repo_id, revision))
        return SimpleNamespace(sha=COMMIT)

    def load_dataset(path, name=None, split=None, streaming=False, revision=None, **kwargs):
        calls.load.append({"path": path, "name": name, "split": split, "streaming": streaming, "revision": revision})
        return iter(calls.rows)

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", dataset_info)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_hub_specs_parse_and_print_back():
    assert HubSpec.parse("hf:Salesforce/wikitext:wikitext-103-raw-v1:train@main") == HubSpec(
        "Salesforce/wikitext", "wikitext-103-raw-v1", "train", "main"
    )
    assert HubSpec.parse("hf:roneneldan/TinyStories:validation") == HubSpec(
        "roneneldan/TinyStories", None, "validation"
    )
    for text in ("hf:a/b:c:train@refs/convert/parquet", "hf:a:train", f"hf:a/b:x:test@{COMMIT}"):
        assert str(HubSpec.parse(text)) == text
    assert HubSpec.parse(f"hf:a:train@{COMMIT}").pinned and not HubSpec.parse("hf:a:train@main").pinned
    for bad in ("hf:onlyname", "hf:a:b:c:d", "hf:a::train", "hf:a:train@"):
        with pytest.raises(DataError, match=r"write hf:NAME\[:CONFIG\]:SPLIT\[@REVISION\]"):
            HubSpec.parse(bad)


def test_a_hub_dataset_is_streamed_at_a_pinned_commit_and_recorded(tmp_path, hub):
    spec = "hf:org/corpus:cfg:train"
    data = prepare_dir(spec, None, str(tmp_path / "p"), val_fraction=0.0)
    assert data.tokenizer().decode(_tokens(data.path)) == "".join(doc + "\n" for doc in DOCS)
    assert hub.info == [("org/corpus", None)]
    call = {"path": "org/corpus", "name": "cfg", "split": "train", "streaming": True, "revision": COMMIT}
    assert hub.load == [call, call]  # char level reads twice: the vocabulary, then the ids
    assert data.meta["sources"] == [f"{spec}@{COMMIT}"] and data.path.name.startswith("corpus-char-")
    assert data.meta["source_details"] == [{"source": f"{spec}@{COMMIT}", "format": "hub", "column": "text",
        "name": "org/corpus", "config": "cfg", "split": "train", "revision": "main", "commit": COMMIT}]  # fmt: skip
    # the fingerprint is name + config + split + commit: no download needed to recompute it, a new commit differs
    settings = {"tokenizer": "char", "val_fraction": 0.0, "errors": "strict"}
    assert fingerprint(resolve_sources(f"{spec}@{COMMIT}"), settings) == data.meta["fingerprint"]
    assert fingerprint(resolve_sources(f"{spec}@{'f' * 40}"), settings) != data.meta["fingerprint"]
    assert hub.info == [("org/corpus", None)]  # a pinned spec asks the Hub nothing
    # a checkpoint finds it again from its record alone, and prepares it again at the recorded commit
    config = {"tokenizer": "char", "val_fraction": 0.0, "errors": "strict", "glob": "*.txt", "input": spec}
    assert recorded_data("x.ckpt", data.record(), config, data.meta["tokenizer"]).path == data.path.resolve()
    shutil.rmtree(data.path)
    again = recorded_data("x.ckpt", data.record(), config, data.meta["tokenizer"])
    assert again.meta["fingerprint"] == data.meta["fingerprint"] and len(hub.info) == 1
    assert hub.load == [call] * 4


def _bad_jsonl(tmp: Path, payload: bytes, name: str = "bad.jsonl") -> Path:
    (tmp / name).write_bytes(payload)
    return tmp / name


BAD_JSONL = [
    (b'{"body": "x", "n": 1}\n', r"bad\.jsonl:1 has no 'text' field \(its fields: 'body', 'n'\); pass --data.text_"),
    (b'{"text": "a"}\n\n{"text": oops}\n', r"bad\.jsonl:3: invalid JSON \(Expecting value at column 10\)"),
    (b'{"text": 5}\n', r"bad\.jsonl:1: field 'text' holds a JSON int, not a string"),
    (b'["text"]\n', r"bad\.jsonl:1: a JSON list where an object with a 'text' field belongs"),
    (b"", r"bad\.jsonl has no documents \(no non-empty 'text' values\)"),
    (b'{"text": ""}\n{"text": null}\n', r"bad\.jsonl has no documents"),
    (b'{"text": "caf\xe9"}\n', r"bad\.jsonl:1 is not valid UTF-8 .* --data.errors replace"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", r"bad\.jsonl looks like a binary file \(it contains NUL bytes\)"),
]


BAD_IDS = [
    "missing-column",
    "invalid-json",
    "non-string",
    "not-an-object",
    "empty",
    "no-documents",
    "latin-1",
    "binary",
]


@pytest.mark.parametrize(("payload", "needle"), BAD_JSONL, ids=BAD_IDS)
def test_each_bad_json_lines_file_is_one_line_that_names_it(tmp_path, payload, needle):
    with pytest.raises(DataError, match=needle) as info:
        prepare(str(_bad_jsonl(tmp_path, payload)), str(tmp_path / "out"))
    assert "\n" not in str(info.value) and not (tmp_path / "out" / "meta.json").exists()


def test_a_gz_that_is_not_gzip_is_named(tmp_path):
    with pytest.raises(DataError, match=r"bad\.jsonl\.gz is not a readable gzip file"):
        prepare(str(_bad_jsonl(tmp_path, b'{"text": "plain"}\n', "bad.jsonl.gz")), str(tmp_path / "out"))


def test_bad_parquet_files_are_one_line_each(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"body": ["a"], "n": [1]}), tmp_path / "cols.parquet")
    pq.write_table(pa.table({"text": [None, ""], "n": [1, 2]}), tmp_path / "empty.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"this is not parquet at all")
    cases = [
        ("cols.parquet", "text", r"cols\.parquet has no column 'text' \(its columns: body, n\); pass --data.text_"),
        ("cols.parquet", "n", r"Column 'n' of .*cols\.parquet holds int64, not strings \(its string columns: body\)"),
        ("empty.parquet", "text", r"empty\.parquet has no documents"),
        ("junk.parquet", "text", r"Cannot read .*junk\.parquet as Parquet \("),
    ]
    for name, column, needle in cases:
        with pytest.raises(DataError, match=needle) as info:
            prepare(str(tmp_path / name), str(tmp_path / "out"), text_column=column)
        assert "\n" not in str(info.value)


def test_bad_saved_datasets_and_directories_say_what_to_pass(tmp_path):
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict({"body": ["a", "b"]})
    dataset.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": dataset, "test": dataset}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"saved has no column 'text' \(its columns: body\)"):
        prepare(str(tmp_path / "saved"), str(tmp_path / "out"))
    with pytest.raises(DataError, match=r"dict holds a DatasetDict with the splits test, train: pass one split's "):
        prepare(str(tmp_path / "dict"), str(tmp_path / "out"))
    (tmp_path / "shards").mkdir()
    _jsonl(tmp_path / "shards" / "a.jsonl", [{"text": "x"}])
    with pytest.raises(DataError, match=r"no files matching '\*\.txt'; pass --data.glob PATTERN \(it has \.jsonl "):
        prepare(str(tmp_path / "shards"), str(tmp_path / "out"))


def test_hub_errors_name_the_column_and_the_missing_package(tmp_path, hub, monkeypatch):
    hub.rows = [{"content": "x", "n": 1}]
    with pytest.raises(DataError, match=r"hf:org/c:train@0123.* has no column 'text' \(its columns: content, n\)"):
        prepare("hf:org/c:train", str(tmp_path / "out"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(DataError, match=r"needs the datasets package, which is not installed: pip install 'posgpt\[hf"):
        prepare("hf:org/c:train", str(tmp_path / "out"))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(
        DataError, match=r"needs the pyarrow package, which is not installed: pip install 'posgpt\[parq"
    ):
        prepare(str(tmp_path / "x.parquet"), str(tmp_path / "out"))


def test_a_json_lines_corpus_trains_and_its_checkpoint_records_it(tmp_path):
    from posgpt.core.checkpoint import read_checkpoint
    from posgpt.model import GPTConfig
    from posgpt.training.config import DataConfig, OptimConfig, RunConfig, TrainConfig
    from posgpt.training.run import train

    rows = [{"text": line} for line in (" ".join(DOCS[:2]) + " ").split(".") * 40 if line.strip()]
    path = _jsonl(tmp_path / "train.jsonl", rows)
    cfg = RunConfig(
        model=GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16),
        data=DataConfig(input=str(path), prepared_root=str(tmp_path / "prepared")),
        optim=OptimConfig(lr=3e-3, warmup_steps=1),
        train=TrainConfig(max_steps=2, batch_size=4, eval_interval=2, eval_tokens=64, out_dir=str(tmp_path / "runs"),
                          run_name="jsonl", logger="none", progress_bar=False, sample_tokens=0),
    )  # fmt: skip
    ckpt = read_checkpoint(train(cfg).last_ckpt)
    assert ckpt["global_step"] == 2
    record = ckpt["hyper_parameters"]["data"]
    assert record["source_details"] == [{"source": str(path.resolve()), "format": "jsonl", "column": "text"}]


def test_a_saved_datasets_fingerprint_ignores_cache_files_beside_it(tmp_path):
    saved = write_saved_dataset(tmp_path)
    first = prepare_dir(str(saved), None, str(tmp_path / "p"))
    (saved / "cache-0123456789abcdef.arrow").write_bytes(b"left by a .map() of the user's")
    assert prepare_dir(str(saved), None, str(tmp_path / "p")).meta["fingerprint"] == first.meta["fingerprint"]
    (saved / "dataset_info.json").write_text((saved / "dataset_info.json").read_text() + " ")
    assert prepare_dir(str(saved), None, str(tmp_path / "p")).meta["fingerprint"] != first.meta["fingerprint"]


def test_bpe_pieces_are_encoded_on_threads_each_on_its_own(gpt2_ranks):
    """Joined into one call per thread, each text still gets exactly its own ids, end tokens only after
    documents; a text that holds the string <|endoftext|> stays plain text."""
    tok = GPT2Tokenizer(gpt2_ranks)
    texts = [doc * n for n in (1, 50, 3, 0, 7, 200, 1) for doc in DOCS]
    texts += ["  trailing spaces  ", "\n\n", " leading", "says <|endoftext|> in its text", "", "x"]
    ends = [i % 3 != 1 for i in range(len(texts))]
    expected = [i for text, end in zip(texts, ends, strict=True) for i in tok.encode(text) + [tok.end_id] * end]
    for threads in (1, 3):
        assert tok.encode_pieces(texts, ends, threads).tolist() == expected


def test_progress_is_logged_every_tenth_where_there_is_no_terminal(monkeypatch, caplog):
    monkeypatch.setattr(prepare_module, "QUIET_SECONDS", 0.0)
    progress = prepare_module.ReadProgress("tokenizing", 4_000_000, interactive=False)
    with caplog.at_level(logging.INFO, logger="posgpt.data.prepare"):
        for read in range(100_000, 4_000_001, 100_000):
            progress.update(read, read // 4)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 10 and lines[0].startswith("tokenizing: 10% (0.4 of 4.0 MB read, 100,000 tokens, ")
    assert lines[-1].startswith("tokenizing: 100% (4.0 of 4.0 MB read, 1,000,000 tokens, ") and "MB/s)" in lines[-1]


def test_documents_in_two_formats_get_two_run_directories(tmp_path):
    """code.jsonl and code.parquet are two corpora: two prepared and two run directories, not one."""
    import train as train_script
    from posgpt.core import cli
    from posgpt.training.run import corpus_data, run_dir_of

    from helpers import tiny_args

    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    jsonl = tmp_path / "code.jsonl"
    jsonl.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in DOCS * 40), encoding="utf-8")
    pq.write_table(pa.table({"text": DOCS * 40}), tmp_path / "code.parquet")
    dirs = []
    for path in (jsonl, tmp_path / "code.parquet"):
        cfg = cli.parse(train_script.COMMAND, tiny_args(tmp_path, path)[:-2])  # no --train.run_name: the default
        dirs.append(run_dir_of(cfg, corpus_data(cfg)).name)
    assert dirs == ["code-jsonl-char-rope", "code-parquet-char-rope"]
