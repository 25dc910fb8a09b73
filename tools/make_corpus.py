"""Writes the Python-standard-library text corpus as JSON lines (no download needed).

Example::

    python tools/make_corpus.py --output data/corpus.jsonl
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_dilocox.data.corpus import build_stdlib_corpus  # noqa: E402


def main() -> None:
    """Entry point: builds the corpus and prints its size."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument("--max-docs", type=int, default=None, help="stop after N documents")
    args = parser.parse_args()
    if args.max_docs is not None and args.max_docs < 1:
        parser.error(f"--max-docs: must be >= 1, got {args.max_docs}")
    start = time.time()
    docs = build_stdlib_corpus(args.output, args.max_docs)
    size_mb = os.path.getsize(args.output) / 1e6
    elapsed = time.time() - start
    print(f"wrote {docs} documents, {size_mb:.2f} MB to {args.output} in {elapsed:.1f}s")


if __name__ == "__main__":
    main()
