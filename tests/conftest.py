import subprocess
import sys

import pytest

from launch import REPO


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    """A small real dataset made with the project's own tools: corpus.jsonl, sp.model, c_text_document."""
    out = tmp_path_factory.mktemp("data")
    corpus = out / "corpus.jsonl"
    steps = [
        ["tools/make_corpus.py", "--output", str(corpus), "--max-docs", "60"],
        ["tools/train_tokenizer.py", "--input", str(corpus), "--json-keys", "text", "--vocab-size", "400",
         "--model-prefix", str(out / "sp")],
        ["tools/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(out / "c"),
         "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(out / "sp.model"), "--append-eod"],
    ]
    for step in steps:
        subprocess.run([sys.executable, *step], cwd=REPO, check=True, capture_output=True)
    return out
