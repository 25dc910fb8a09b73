"""End-to-end tests of the data pipeline: corpus -> tokenizer -> indexed dataset -> GPTDataset."""

import importlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402

from megatron_dilocox.data.corpus import (  # noqa: E402
    MAX_LINE_CHARS,
    MAX_SOURCE_BYTES,
    MIN_DOC_CHARS,
    SOURCES,
    build_corpus,
    corpus_distributions,
    distribution_mismatches,
    iter_documents,
)
from megatron_dilocox.data.tokenizer import (  # noqa: E402
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
)

NUM_DOCS = 50
VOCAB = 500


def _load_tool(name):
    """Imports ``tools/{name}.py`` as a top-level module, picklable for worker pools."""
    tools_dir = os.path.join(REPO, "tools")
    if tools_dir not in sys.path:
        sys.path.insert(0, tools_dir)
    return importlib.import_module(name)


def _run_tool(name, *args):
    """Runs ``tools/{name}.py`` as a script and returns the completed process (checked)."""
    cmd = [sys.executable, "-W", "ignore", os.path.join(REPO, "tools", f"{name}.py"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """Builds corpus, tokenizer and indexed dataset once through the real CLIs."""
    tmp = tmp_path_factory.mktemp("pipeline")
    corpus = str(tmp / "corpus.jsonl")
    spm_prefix = str(tmp / "spm")
    out_prefix = str(tmp / "out" / "corpus")
    _run_tool("make_corpus", "--output", corpus, "--max-docs", str(NUM_DOCS))
    _run_tool(
        "train_tokenizer",
        "--input",
        corpus,
        "--json-keys",
        "text",
        "--model-prefix",
        spm_prefix,
        "--vocab-size",
        str(VOCAB),
        "--num-threads",
        "2",
    )
    proc = _run_tool(
        "preprocess_data",
        "--input",
        corpus,
        "--output-prefix",
        out_prefix,
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        spm_prefix + ".model",
        "--append-eod",
        "--workers",
        "2",
        "--log-interval",
        "10",
    )
    with open(corpus, encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    return {
        "tmp": tmp,
        "corpus": corpus,
        "docs": docs,
        "model": spm_prefix + ".model",
        "prefix": out_prefix + "_text_document",
        "log": proc.stdout + proc.stderr,
    }


def test_corpus_is_deterministic_and_atomic(tmp_path, pipeline):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert build_corpus(str(a), max_docs=NUM_DOCS) == NUM_DOCS
    assert build_corpus(str(b), max_docs=NUM_DOCS) == NUM_DOCS
    assert a.read_bytes() == b.read_bytes() == open(pipeline["corpus"], "rb").read()
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "b.jsonl"]  # no temporary left behind
    assert all(len(doc) >= MIN_DOC_CHARS for doc in pipeline["docs"])
    assert sum(map(len, pipeline["docs"])) > 100_000


_PROSE = "Explains what this part is for, in words enough to count as a document. " * 4


def _fake_install(root):
    """Writes a small fake standard library and site-packages; returns their two paths."""
    alpha = f'"""Alpha. {_PROSE}"""\n\n# Why x is one: {_PROSE}\nx = 1\n'
    files = {
        "stdlib/alpha.py": alpha,
        "stdlib/README.txt": f"Readme. {_PROSE}",
        "stdlib/email/beta.py": f'"""Beta. {_PROSE}"""\nimport os\n',
        "stdlib/test/test_alpha.py": f'"""Test suite, skipped. {_PROSE}"""\n',
        "stdlib/site-packages/inner.py": f'"""Not the stdlib. {_PROSE}"""\n',
        "site/pkg/__init__.py": "",
        "site/pkg/mod.py": f"# Copyright header, kept: {_PROSE}\ndef f():\n    return 1\n",
        "site/pkg/copy_of_alpha.py": alpha,
        "site/__pycache__/cached.py": f"# Cache. {_PROSE}\n",
        "site/__editable___pkg_finder.py": f"MAPPING = {{'pkg': '/abs/checkout'}}  # {_PROSE}\n",
        # Installed distributions: numpy is in the corpus list (at another version here), extra is not.
        "site/numpy/listed.py": f"# Listed. {_PROSE}\n",
        "site/numpy-0.0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: numpy\nVersion: 0.0.1\n",
        "site/numpy-0.0.1.dist-info/RECORD": "numpy/listed.py,,\nnumpy-0.0.1.dist-info/METADATA,,\n",
        "site/extra/unlisted.py": f"# Unlisted. {_PROSE}\n",
        "site/Extra_Pkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: Extra_Pkg\nVersion: 1.0\n",
        "site/Extra_Pkg-1.0.dist-info/RECORD": "extra/unlisted.py,,\nExtra_Pkg-1.0.dist-info/METADATA,,\n",
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    # A PEP 263 latin-1 file with Windows line ends: decoded as Python does, "\r\n" -> "\n".
    latin = f'# -*- coding: latin-1 -*-\r\n"""Caf\xe9. {_PROSE}"""\r\n'.encode("latin-1")
    (root / "stdlib" / "latin.py").write_bytes(latin)
    return str(root / "stdlib"), str(root / "site")


def _fake_corpus(tmp_path, name, source):
    """Builds ``source`` from the fake install under ``tmp_path``; returns file and documents."""
    stdlib_dir, site_dir = _fake_install(tmp_path / "install")
    out = tmp_path / f"{name}.jsonl"
    build_corpus(str(out), source, stdlib_dir=stdlib_dir, site_dirs=[site_dir])
    with open(out, encoding="utf-8") as f:
        return out, [json.loads(line)["text"] for line in f]


def test_each_source_reads_its_places(tmp_path):
    outs = {source: _fake_corpus(tmp_path, source, source) for source in SOURCES}
    docs = {source: out_docs for source, (_, out_docs) in outs.items()}
    prose = docs["stdlib-docs"]
    assert [d.split(".")[0] for d in prose] == ["Readme", "Alpha", "Beta", "Café"]
    assert prose[1].startswith("Alpha.") and "Why x is one" in prose[1] and "x = 1" not in prose[1]
    assert [d.splitlines()[0] for d in docs["stdlib"][len(prose) :]] == [
        '"""Alpha. ' + _PROSE + '"""',
        '"""Beta. ' + _PROSE + '"""',
        "# -*- coding: latin-1 -*-",
    ]
    assert docs["stdlib"][-1] == f'# -*- coding: latin-1 -*-\n"""Café. {_PROSE}"""'
    # New: numpy's file (a listed distribution) and pkg/mod.py (no distribution's); the copy of
    # alpha.py is a duplicate, __init__.py is too short, and caches, editable-install finders and
    # the files of distributions not in the corpus list are not read.
    assert docs["stdlib+site-packages"][len(docs["stdlib"]) :] == [
        f"# Listed. {_PROSE}".strip(), f"# Copyright header, kept: {_PROSE}\ndef f():\n    return 1"
    ]
    assert "Unlisted." not in "".join(docs["stdlib+site-packages"])
    mismatches = distribution_mismatches([str(tmp_path / "install" / "site")])
    assert f"numpy: installed 0.0.1, the corpus list says {corpus_distributions()['numpy']}" in mismatches
    assert f"torch: installed nothing, the corpus list says {corpus_distributions()['torch']}" in mismatches
    assert not any(m.startswith("extra-pkg") for m in mismatches)
    # The pinned environment (constraints-cpu.txt) holds the list's versions: a bump there changes
    # the corpus, and the list (and docs/data.md's figures) must follow. The pinned corpus is
    # Python 3.11's (on 3.12 the standard library, torch and megatron-core differ).
    if sys.version_info[:2] == (3, 11):
        assert distribution_mismatches() == []
    everything = "".join(docs["stdlib+site-packages"])
    assert "skipped" not in everything and "Not the stdlib" not in everything
    assert "Cache." not in everything and "/abs/checkout" not in everything
    # Each choice's file extends the one before, byte for byte.
    small, medium, large = (outs[source][0].read_bytes() for source in SOURCES)
    assert medium.startswith(small) and large.startswith(medium)


def test_build_is_deterministic_and_deduplicated(tmp_path):
    a, docs = _fake_corpus(tmp_path / "a", "out", "stdlib+site-packages")
    b, _ = _fake_corpus(tmp_path / "b", "out", "stdlib+site-packages")
    assert a.read_bytes() == b.read_bytes()  # two builds, from two places
    assert len(set(docs)) == len(docs)  # no document on both sides of a --split
    assert sorted(os.listdir(tmp_path / "a")) == ["install", "out.jsonl"]  # no temporary left
    stdlib_dir, site_dir = _fake_install(tmp_path / "c")
    (tmp_path / "c" / "site" / "pkg" / "mod2.py").write_text("\n\n" + docs[-1] + "\n  \n")
    dup = list(iter_documents("stdlib+site-packages", stdlib_dir, [site_dir]))
    assert dup == docs  # the same text up to surrounding whitespace counts once


def test_shuffled_corpus_is_a_seeded_permutation(tmp_path):
    stdlib_dir, site_dir = _fake_install(tmp_path / "install")
    built = {}
    for name, seed in (("path", None), ("s1", 1), ("s1_again", 1), ("s2", 2)):
        out = tmp_path / f"{name}.jsonl"
        build_corpus(str(out), "stdlib+site-packages", stdlib_dir=stdlib_dir, site_dirs=[site_dir],
                     shuffle_seed=seed)
        built[name] = out.read_bytes().splitlines()
    assert built["s1"] == built["s1_again"]  # deterministic for a seed
    assert sorted(built["s1"]) == sorted(built["s2"]) == sorted(built["path"])  # the same documents
    assert len({tuple(lines) for lines in built.values()}) == 3  # each seed its own order
    # --max-docs takes the first documents in path order, then permutes them.
    few = tmp_path / "few.jsonl"
    build_corpus(str(few), "stdlib+site-packages", max_docs=3, stdlib_dir=stdlib_dir,
                 site_dirs=[site_dir], shuffle_seed=1)
    assert sorted(few.read_bytes().splitlines()) == sorted(built["path"][:3])


def test_source_size_limits(tmp_path):
    stdlib_dir, _ = _fake_install(tmp_path)
    names = ("line_ok", "line_long", "size_ok", "size_big")
    heads = {name: f"# {name}: {_PROSE}\n" for name in names}
    texts = {
        "line_ok": heads["line_ok"] + "x" * MAX_LINE_CHARS,
        "line_long": heads["line_long"] + "x" * (MAX_LINE_CHARS + 1),
        # ASCII, so characters are bytes; the padding lines are empty, hence short.
        "size_ok": heads["size_ok"].ljust(MAX_SOURCE_BYTES, "\n"),
        "size_big": heads["size_big"].ljust(MAX_SOURCE_BYTES + 1, "\n"),
    }
    for name, text in texts.items():
        (tmp_path / "stdlib" / f"{name}.py").write_bytes(text.encode("ascii"))
    prose = list(iter_documents("stdlib-docs", stdlib_dir))
    code = list(iter_documents("stdlib", stdlib_dir))[len(prose) :]
    kept = {name for name in texts if any(doc.startswith(f"# {name}:") for doc in code)}
    assert kept == {"line_ok", "size_ok"}
    # The limits only concern whole files: the comments of all four are still prose.
    assert all(any(doc.startswith(f"{name}:") for doc in prose) for name in texts)


def test_make_corpus_cli(pipeline, tmp_path, capsys):
    main = _load_tool("make_corpus").main
    out = str(tmp_path / "c.jsonl")
    message = _exit_message(main, ["--output", out, "--source", "stdlib-src"], capsys)
    assert ": error: argument --source: invalid choice: 'stdlib-src' (choose from " in message
    assert all(source in message for source in SOURCES)  # quoted or not, by Python version
    assert "--count-tokens" in _exit_message(main, ["--output", out, "--count-tokens", out], capsys)
    assert not os.path.exists(out)
    with pytest.raises(ValueError, match="stdlib-src"):
        iter_documents("stdlib-src")
    # The token count equals what preprocess_data wrote for the same documents and model.
    main(["--output", out, "--max-docs", str(NUM_DOCS), "--count-tokens", pipeline["model"]])
    tokens = sum(len(doc) for doc in IndexedDataset(pipeline["prefix"]))
    stdout = capsys.readouterr().out
    assert f"wrote {NUM_DOCS} documents" in stdout
    assert f"{tokens} tokens (one eod per document)" in stdout


def test_tokenizer_properties(pipeline):
    tok = SentencePieceTokenizer(pipeline["model"])
    assert tok.vocab_size == VOCAB
    assert (tok.pad, tok.unk, tok.bos, tok.eod) == (0, 1, 2, 3)
    assert tok.eos == tok.eod
    text = "Return the value of x, déjà vu ∑."
    assert tok.detokenize(tok.tokenize(text)) == text  # byte fallback keeps rare chars
    assert tok.unique_identifiers["class"] == "SentencePieceTokenizer"
    assert build_tokenizer("SentencePieceTokenizer", pipeline["model"]).vocab_size == VOCAB


def test_preprocess_roundtrip(pipeline):
    tok = SentencePieceTokenizer(pipeline["model"])
    dataset = IndexedDataset(pipeline["prefix"])
    assert len(dataset) == len(pipeline["docs"]) == NUM_DOCS
    assert dataset.index.dtype == np.uint16
    for i, doc in enumerate(pipeline["docs"]):
        assert dataset[i].tolist() == tok.tokenize(doc) + [tok.eod]
    assert "docs/s" in pipeline["log"] and "wrote 50 documents" in pipeline["log"]
    out_dir = os.path.dirname(pipeline["prefix"])
    suffixes = [".bin", ".idx", ".tokenizer.json"]
    assert sorted(os.listdir(out_dir)) == [f"corpus_text_document{s}" for s in suffixes]


def test_gpt_dataset_reads_preprocessed_data(pipeline):
    tok = SentencePieceTokenizer(pipeline["model"])
    seq_len = 64
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=seq_len,
        blend=([pipeline["prefix"]], None),
        split="90,10,0",
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mmap_bin_files=True,
        path_to_cache=str(pipeline["tmp"] / "index_cache"),
    )
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [100, 10, None], lambda: True, config
    ).build()
    assert test is None and len(train) >= 100 and len(valid) >= 10
    # Every window must be cut from the documents: split it at eod and find each piece.
    haystack = "|".join(" " + " ".join(map(str, tok.tokenize(d))) + " " for d in pipeline["docs"])
    for dataset in (train, valid):
        for idx in range(0, len(dataset), max(1, len(dataset) // 20)):
            sample = dataset[idx]
            tokens, labels = sample["tokens"], sample["labels"]
            assert tokens.shape == labels.shape == (seq_len,)
            assert tokens[1:].tolist() == labels[:-1].tolist()
            window = tokens.tolist() + labels[-1:].tolist()
            assert max(window) < tok.vocab_size
            pieces = " ".join(map(str, window)).split(f" {tok.eod} ")
            assert all(f" {piece.strip()} " in haystack for piece in pieces if piece.strip())
    assert os.listdir(config.path_to_cache)  # sample indices were cached


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", None, vocab_size_for_null=100)
    assert isinstance(tok, NullTokenizer)
    assert (tok.vocab_size, tok.eod, tok.pad) == (101, 100, -1)
    assert tok.tokenize("5 7  9") == [5, 7, 9]
    assert tok.detokenize([5, 7]) == "5 7"


@pytest.mark.parametrize(
    "args, message",
    [
        (("SentencePieceTokenizer", "/nonexistent/spm.model"), "/nonexistent/spm.model"),
        (("Bogus", None), "--tokenizer-type"),
        (("NullTokenizer", None), "--vocab-size"),
    ],
)
def test_build_tokenizer_errors(args, message):
    with pytest.raises(ValueError, match=message):
        build_tokenizer(*args)


def test_invalid_sentencepiece_model(pipeline):
    with pytest.raises(ValueError) as info:
        SentencePieceTokenizer(pipeline["corpus"])
    assert str(info.value) == f"not a valid sentencepiece model: {pipeline['corpus']}"


def _exit_message(main, argv, capsys):
    """Runs a tool's ``main(argv)`` expecting a user error; returns its one-line message."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    if isinstance(info.value.code, str):  # sys.exit("error: ...")
        message = info.value.code
    else:  # argparse's parser.error: usage, then the message as the last stderr line
        assert info.value.code == 2
        message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "\n" not in message and "Traceback" not in message
    return message


def test_preprocess_errors(pipeline, tmp_path, capsys):
    main = _load_tool("preprocess_data").main
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n', encoding="utf-8")
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"body": "fine"}\n', encoding="utf-8")
    prefix = str(tmp_path / "out" / "x")
    base = ["--output-prefix", prefix, "--tokenizer-model", pipeline["model"]]

    missing = str(tmp_path / "missing.jsonl")
    assert _exit_message(main, ["--input", missing] + base, capsys).endswith(
        f": error: --input: file not found: {missing}"  # argparse prefixes the program name
    )
    for workers in ("1", "2"):
        assert _exit_message(main, ["--input", str(bad), "--workers", workers] + base, capsys) == (
            f"error: {bad}:2: invalid JSON: Expecting value"
        )
    assert _exit_message(main, ["--input", str(nokey)] + base, capsys) == (
        f"error: {nokey}:1: no string value for JSON key 'text'"
    )
    bad_model = ["--input", str(nokey), "--output-prefix", prefix, "--tokenizer-model", str(bad)]
    expected = f"error: not a valid sentencepiece model: {bad}"
    assert _exit_message(main, bad_model, capsys) == expected
    # Failed runs leave nothing under the final names, nor temporaries.
    assert not os.path.exists(tmp_path / "out") or os.listdir(tmp_path / "out") == []


def test_train_tokenizer_errors(tmp_path, capsys):
    main = _load_tool("train_tokenizer").main
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n', encoding="utf-8")
    prefix = ["--model-prefix", str(tmp_path / "spm")]
    missing = str(tmp_path / "missing.txt")
    assert _exit_message(main, ["--input", missing] + prefix, capsys).endswith(
        f": error: --input: file not found: {missing}"
    )
    assert _exit_message(main, ["--input", str(bad), "--json-keys", "text"] + prefix, capsys) == (
        f"error: {bad}:2: invalid JSON: Expecting value"
    )
    assert not os.path.exists(tmp_path / "spm.model")


def test_train_tokenizer_is_reproducible(pipeline, tmp_path):
    main = _load_tool("train_tokenizer").main
    for name in ("a", "b"):
        argv = ["--input", pipeline["corpus"], "--json-keys", "text", "--vocab-size", "400"]
        main(argv + ["--model-prefix", str(tmp_path / name), "--input-sentence-size", "500"])
    assert (tmp_path / "a.vocab").read_bytes() == (tmp_path / "b.vocab").read_bytes()
