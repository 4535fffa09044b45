"""tools/preprocess_data.py, train_tokenizer.py and stdlib_corpus.py, driven like a user drives them."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from megalite.config.schema import DataConfig
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.tokenizers import build_tokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
                                "tools"))
import preprocess_data  # noqa: E402


def sp_args(sp_model):
    return ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model]


def run_inprocess(capsys, *argv):
    """preprocess_data.main in this process (fast); returns (rc, stdout, stderr)."""
    rc = preprocess_data.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def expected_docs(tok, texts, append_eod=True):
    return [tok.tokenize(t) + ([tok.eod] if append_eod else []) for t in texts if tok.tokenize(t)]


def test_cli_jsonl_two_workers_round_trip(tmp_path, sp_model, corpus_texts, write_jsonl, run_tool):
    texts = corpus_texts(80)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t, "id": i} for i, t in enumerate(texts)])
    proc = run_tool("preprocess_data.py", "--input", src, "--output-prefix", tmp_path / "out", *sp_args(sp_model),
                    "--append-eod", "--workers", "2", "--log-interval", "10", check=True)
    assert "done: 80 documents" in proc.stdout and "docs/s" in proc.stdout and "tokens/s" in proc.stdout
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    tok = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model))
    want = expected_docs(tok, texts)
    assert ds.dtype == np.uint16 and len(ds) == len(want) == 80
    for i, w in enumerate(want):
        assert ds[i].tolist() == w
    assert tok.detokenize(ds[3][:-1]) == texts[3]
    np.testing.assert_array_equal(ds.document_indices, np.arange(81))
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out_text_document.bin", "out_text_document.idx"]


def test_workers_give_identical_files(tmp_path, sp_model, corpus_texts, write_jsonl, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in corpus_texts(300)])
    for w in (1, 3):
        rc, out, err = run_inprocess(capsys, "--input", src, "--output-prefix", tmp_path / f"w{w}",
                                     *sp_args(sp_model), "--append-eod", "--workers", w)
        assert rc == 0, err
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w1_text_document{ext}").read_bytes() == (tmp_path / f"w3_text_document{ext}").read_bytes()


def test_parquet_arrow_saved_dataset_and_glob(tmp_path, sp_model, corpus_texts, capsys):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = corpus_texts(30)
    table = pa.table({"text": texts[:10], "n": list(range(10))})
    pq.write_table(table, tmp_path / "a.parquet")
    with pa.ipc.new_file(str(tmp_path / "b.arrow"), table.schema) as w:
        w.write_table(pa.table({"text": texts[10:20], "n": list(range(10))}))
    datasets.Dataset.from_dict({"text": texts[20:30]}).save_to_disk(str(tmp_path / "saved"))
    rc, out, err = run_inprocess(capsys, "--input", tmp_path / "a.parquet", tmp_path / "b.arrow", tmp_path / "saved",
                                 "--output-prefix", tmp_path / "mix", *sp_args(sp_model))
    assert rc == 0, err
    tok = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model))
    ds = IndexedDataset(str(tmp_path / "mix_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == expected_docs(tok, texts, append_eod=False)
    # Arrow stream format and a glob over several JSONL files, in sorted order
    with pa.ipc.new_stream(str(tmp_path / "s.arrow"), table.schema) as w:
        w.write_table(table)
    for i in range(3):
        with open(tmp_path / f"part{i}.jsonl", "w") as f:
            f.write(json.dumps({"text": f"{i} {i}"}) + "\n")
    rc, out, err = run_inprocess(capsys, "--input", str(tmp_path / "part*.jsonl"), "--output-prefix", tmp_path / "g",
                                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--append-eod")
    assert rc == 0, err
    g = IndexedDataset(str(tmp_path / "g_text_document"))
    assert [g[i].tolist() for i in range(3)] == [[0, 0, 10], [1, 1, 10], [2, 2, 10]]
    rc, _, err = run_inprocess(capsys, "--input", tmp_path / "s.arrow", "--output-prefix", tmp_path / "s",
                               *sp_args(sp_model))
    assert rc == 0, err
    assert len(IndexedDataset(str(tmp_path / "s_text_document"))) == 10


def test_several_json_keys(tmp_path, write_jsonl, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2", "summary": "3"}, {"text": "4", "summary": "5 6"}])
    rc, out, err = run_inprocess(capsys, "--input", src, "--json-keys", "text", "summary", "--output-prefix",
                                 tmp_path / "o", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100")
    assert rc == 0, err
    assert [x.tolist() for x in IndexedDataset(str(tmp_path / "o_text_document"))[0:2]] == [[1, 2], [4]]
    assert [x.tolist() for x in IndexedDataset(str(tmp_path / "o_summary_document"))[0:2]] == [[3], [5, 6]]


# ------------------------------------------------------------------------------------ bad inputs
NULL_TOK = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


def _fails(capsys, tmp_path, one_line_error, *argv) -> str:
    rc, out, err = run_inprocess(capsys, *argv)
    assert rc == 1
    line = one_line_error(err)
    leftovers = [f for f in os.listdir(tmp_path) if f.endswith((".bin", ".idx")) or ".tmp" in f]
    assert leftovers == [], leftovers  # nothing half-written
    return line


def test_malformed_json_line_names_file_and_line(tmp_path, write_jsonl, capsys, one_line_error):
    src = write_jsonl(tmp_path / "in.jsonl", ['{"text": "1 2"}', "", '{"text": "3"', '{"text": "4"}'])
    line = _fails(capsys, tmp_path, one_line_error, "--input", src, "--output-prefix", tmp_path / "o", *NULL_TOK)
    assert f"{src}:3: malformed JSON" in line and "--skip-bad-lines" in line
    rc, out, err = run_inprocess(capsys, "--input", src, "--output-prefix", tmp_path / "o", *NULL_TOK,
                                 "--skip-bad-lines")
    assert rc == 0, err
    assert "skipped 1 bad line(s)" in out and f"{src}:3" in out
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    assert [x.tolist() for x in ds[0:2]] == [[1, 2], [4]]


def test_missing_json_key(tmp_path, write_jsonl, capsys, one_line_error):
    src = write_jsonl(tmp_path / "in.jsonl", [{"content": "1 2"}])
    line = _fails(capsys, tmp_path, one_line_error, "--input", src, "--output-prefix", tmp_path / "o", *NULL_TOK)
    assert f"{src}:1: no key 'text'" in line and "content" in line and "--json-keys" in line
    src2 = write_jsonl(tmp_path / "in2.jsonl", [{"text": 5}])
    assert "is int, not a string" in _fails(capsys, tmp_path, one_line_error, "--input", src2, "--output-prefix",
                                            tmp_path / "o", *NULL_TOK)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    assert "no column 'text'" in _fails(capsys, tmp_path, one_line_error, "--input", tmp_path / "p.parquet",
                                        "--output-prefix", tmp_path / "o", *NULL_TOK)


def test_empty_input(tmp_path, capsys, one_line_error):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    line = _fails(capsys, tmp_path, one_line_error, "--input", tmp_path / "empty.jsonl", "--output-prefix",
                  tmp_path / "o", *NULL_TOK)
    assert "empty" in line
    assert "no such file" in _fails(capsys, tmp_path, one_line_error, "--input", tmp_path / "nope.jsonl",
                                    "--output-prefix", tmp_path / "o", *NULL_TOK)
    assert "matches nothing" in _fails(capsys, tmp_path, one_line_error, "--input", str(tmp_path / "*.parquet"),
                                       "--output-prefix", tmp_path / "o", *NULL_TOK)


def test_vocab_too_large_for_dtype(tmp_path, write_jsonl, capsys, one_line_error):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 300"}])
    line = _fails(capsys, tmp_path, one_line_error, "--input", src, "--output-prefix", tmp_path / "o",
                  "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--dtype", "uint8")
    assert "vocab size 1001" in line and "too large for dtype uint8" in line
    # a tokenizer that emits ids beyond its own vocabulary is caught too
    line = _fails(capsys, tmp_path, one_line_error, "--input", src, "--output-prefix", tmp_path / "o",
                  "--tokenizer-type", "NullTokenizer", "--vocab-size", "100")
    assert "id 300 outside its vocabulary of 101" in line


def test_never_overwrites_unless_asked(tmp_path, write_jsonl, capsys, one_line_error, run_tool):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3"}])
    rc, _, err = run_inprocess(capsys, "--input", src, "--output-prefix", tmp_path / "o", *NULL_TOK)
    assert rc == 0, err
    before = (tmp_path / "o_text_document.bin").read_bytes()
    write_jsonl(tmp_path / "in.jsonl", [{"text": "7 8"}])
    proc = run_tool("preprocess_data.py", "--input", src, "--output-prefix", tmp_path / "o", *NULL_TOK)
    assert proc.returncode == 1
    assert "o_text_document.bin already exists; pass --overwrite" in one_line_error(proc.stderr)
    assert (tmp_path / "o_text_document.bin").read_bytes() == before
    rc, _, err = run_inprocess(capsys, "--input", src, "--output-prefix", tmp_path / "o", *NULL_TOK, "--overwrite")
    assert rc == 0, err
    assert IndexedDataset(str(tmp_path / "o_text_document"))[0].tolist() == [7, 8]


def test_split_sentences_rejected(tmp_path, write_jsonl, capsys, one_line_error):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1"}])
    assert "--split-sentences is not supported" in _fails(capsys, tmp_path, one_line_error, "--input", src,
                                                          "--output-prefix", tmp_path / "o", *NULL_TOK,
                                                          "--split-sentences")


# ----------------------------------------------------------------------------- the other tools
def test_train_tokenizer_cli(tmp_path, corpus_texts, write_jsonl, run_tool, one_line_error):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in corpus_texts(100)])
    prefix = tmp_path / "tok"
    proc = run_tool("train_tokenizer.py", "--input", src, "--vocab-size", "400", "--output-prefix", prefix,
                    check=True)
    assert "wrote" in proc.stdout
    tok = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=f"{prefix}.model"))
    assert tok.vocab_size == 400 and tok.eod == 2
    for t in corpus_texts(10):
        assert tok.detokenize(tok.tokenize(t)) == t
    again = run_tool("train_tokenizer.py", "--input", src, "--vocab-size", "400", "--output-prefix", prefix)
    assert again.returncode == 1 and "already exists" in one_line_error(again.stderr)
    small = run_tool("train_tokenizer.py", "--input", src, "--vocab-size", "280", "--output-prefix", tmp_path / "s")
    assert small.returncode == 1 and "Vocabulary size is smaller" in one_line_error(small.stderr)
    (tmp_path / "empty.jsonl").write_text("")
    empty = run_tool("train_tokenizer.py", "--input", tmp_path / "empty.jsonl", "--vocab-size", "300",
                     "--output-prefix", tmp_path / "e")
    assert empty.returncode == 1 and "empty input" in one_line_error(empty.stderr)


def test_stdlib_corpus_cli(tmp_path, run_tool, one_line_error):
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "site-packages").mkdir()
    (root / "b.py").write_text("print('b')\n")
    (root / "a.py").write_text("print('a')\n")
    (root / "pkg" / "c.py").write_text("x = 'ç'\n")
    (root / "bad.py").write_bytes(b"x = '\xff\xfe'\n")     # not UTF-8: skipped
    (root / "test" / "test_x.py").write_text("assert 1\n")
    (root / "site-packages" / "other.py").write_text("import y\n")
    (root / "notes.txt").write_text("not python\n")
    out = tmp_path / "c.jsonl"
    proc = run_tool("stdlib_corpus.py", "--output", out, "--root", root, check=True)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["path"] for x in lines] == ["a.py", "b.py", "pkg/c.py"]
    assert lines[2]["text"] == "x = 'ç'\n"
    assert "1 non-UTF-8" in proc.stdout
    first = out.read_bytes()
    assert run_tool("stdlib_corpus.py", "--output", out, "--root", root).returncode == 1
    run_tool("stdlib_corpus.py", "--output", out, "--root", root, "--overwrite", check=True)
    assert out.read_bytes() == first  # deterministic
    run_tool("stdlib_corpus.py", "--output", out, "--root", root, "--include-tests", "--overwrite", check=True)
    assert "test/test_x.py" in out.read_text()
    # the real standard library, capped
    proc = run_tool("stdlib_corpus.py", "--output", tmp_path / "real.jsonl", "--max-mb", "0.3", check=True)
    real = (tmp_path / "real.jsonl").read_text().splitlines()
    size = sum(len(json.loads(x)["text"].encode()) for x in real)
    assert len(real) > 5 and size <= 0.3 * 1024 * 1024
    assert "stopped at --max-mb" in proc.stdout


@pytest.mark.parametrize("tool", ["preprocess_data.py", "train_tokenizer.py", "merge_datasets.py",
                                  "stdlib_corpus.py"])
def test_tools_have_help(tool, run_tool):
    proc = run_tool(tool, "--help", check=True)
    assert "--input" in proc.stdout or "--output" in proc.stdout
