"""Writes a text corpus built from the Python installation as JSON lines (no download needed).

Example::

    python tools/make_corpus.py --output data/corpus.jsonl
    python tools/make_corpus.py --source stdlib+site-packages --shuffle-seed 1 \
        --output data/big/corpus.jsonl --count-tokens data/big/sp.model

``--source`` picks how much of the installation is read (see
``megatron_dilocox.data.corpus``): ``stdlib-docs`` (the default, the standard
library's prose), ``stdlib`` (plus its Python source) or ``stdlib+site-packages``
(plus the installed packages' Python source: of the installed distributions, those listed in
``megatron_dilocox/data/corpus_distributions.txt``; a warning names each listed one installed at
another version, since the corpus then differs from the one docs/data.md describes).
"""

import argparse
import json
import os
import sys
import time
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dilocox.data.corpus import SOURCES, build_corpus, distribution_mismatches  # noqa: E402

PROGRESS_EVERY_S = 5.0
"""Seconds between two progress lines on stderr."""


def _progress(what: str):
    """Returns a ``progress(docs, nbytes)`` callback printing at most every ``PROGRESS_EVERY_S``."""
    start = last = time.time()

    def report(docs: int, nbytes: int) -> None:
        nonlocal last
        now = time.time()
        if now - last >= PROGRESS_EVERY_S:
            last = now
            line = f"{what}: {docs} documents, {nbytes / 1e6:.1f} MB, {now - start:.0f}s"
            print(line, file=sys.stderr, flush=True)

    return report


def count_tokens(corpus_jsonl: str, tokenizer) -> int:
    """Counts the tokens ``tools/preprocess_data.py --append-eod`` would write for a corpus.

    Args:
        corpus_jsonl: A file written by ``build_corpus``.
        tokenizer: The ``SentencePieceTokenizer`` to count with.

    Returns:
        The tokens of every document plus one end-of-document token each.
    """
    report, tokens, nbytes = _progress("counting tokens"), 0, 0
    with open(corpus_jsonl, "rb") as f:
        for docs, line in enumerate(f, 1):
            ids = tokenizer.tokenize(json.loads(line)["text"])
            tokens += len(ids) + 1 if ids else 0
            nbytes += len(line)
            report(docs, nbytes)
    return tokens


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point: builds the corpus and prints its documents, size and (optionally) tokens."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument(
        "--source", choices=SOURCES, default=SOURCES[0], help="what to read (default: %(default)s)"
    )
    parser.add_argument("--max-docs", type=int, default=None, help="stop after N documents")
    parser.add_argument(
        "--shuffle-seed", type=int, default=None, metavar="S",
        help="write the documents in an order permuted with seed S, so that megatron's contiguous"
        " --split takes uniform samples (default: path order)",
    )
    parser.add_argument(
        "--count-tokens", metavar="MODEL", default=None, help="also count tokens with this .model"
    )
    args = parser.parse_args(argv)
    if args.max_docs is not None and args.max_docs < 1:
        parser.error(f"--max-docs: must be >= 1, got {args.max_docs}")
    tokenizer = None
    if args.count_tokens is not None:
        # Imported here: the tokenizer module loads megatron-core and torch (~15 s).
        from megatron_dilocox.data.tokenizer import SentencePieceTokenizer

        try:
            tokenizer = SentencePieceTokenizer(args.count_tokens)
        except ValueError as e:
            parser.error(f"--count-tokens: {e}")
    if args.source == "stdlib+site-packages":
        for mismatch in distribution_mismatches():
            print(f"WARNING: make_corpus.py: {mismatch}: the corpus will differ from the pinned one",
                  file=sys.stderr, flush=True)
    start = time.time()
    docs = build_corpus(args.output, args.source, args.max_docs, progress=_progress("writing"),
                        shuffle_seed=args.shuffle_seed)
    size_mb = os.path.getsize(args.output) / 1e6
    elapsed = time.time() - start
    print(f"wrote {docs} documents, {size_mb:.2f} MB to {args.output} in {elapsed:.1f}s")
    if tokenizer is not None:
        start = time.time()
        tokens = count_tokens(args.output, tokenizer)
        elapsed = time.time() - start
        print(f"{tokens} tokens (one eod per document) with {args.count_tokens} in {elapsed:.1f}s")


if __name__ == "__main__":
    main()
