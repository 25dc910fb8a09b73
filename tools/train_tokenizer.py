"""Trains a SentencePiece BPE tokenizer on plain-text or JSON-lines files.

Example::

    python tools/train_tokenizer.py --input data/corpus.jsonl --json-keys text \
        --model-prefix data/spm8k --vocab-size 8000

Writes ``{model_prefix}.model`` and ``{model_prefix}.vocab``. The special ids are
fixed: pad=0, unk=1, bos=2, eos=3 (eos is the end-of-document token), and
byte fallback is on so that no text is ever unrepresentable. Training lines are
sampled here with a seeded reservoir (SentencePiece's own sampling is not
reproducible), so the same inputs, seed and ``--num-threads`` give the same vocab.
"""

import argparse
import json
import os
import random
import sys
from typing import Iterable, Iterator, List, Optional

import sentencepiece as spm


def _iter_lines(paths: List[str], json_keys: Optional[List[str]]) -> Iterator[str]:
    """Yields the non-empty text lines of the inputs (of the given keys for JSONL).

    Raises:
        ValueError: On a malformed JSON line or missing key (naming file and line) or
            on a file that is not UTF-8.
    """
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                yield from _lines_of(f, path, json_keys)
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not UTF-8 text") from None


def _lines_of(f: Iterable[str], path: str, json_keys: Optional[List[str]]) -> Iterator[str]:
    """Yields the non-empty text lines of one open input file."""
    for lineno, line in enumerate(f, 1):
        texts = [line]
        if json_keys is not None and line.strip():
            try:
                record = json.loads(line)
                texts = [str(record[key]) for key in json_keys]
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
            except (KeyError, TypeError):
                raise ValueError(f"{path}:{lineno}: missing JSON key(s) {json_keys}") from None
        for text in texts:
            yield from (s for s in text.splitlines() if s.strip())


def _sample(lines: Iterable[str], size: int, seed: int) -> List[str]:
    """Returns a uniform sample of ``size`` lines (all lines if ``size`` is 0)."""
    if size == 0:
        return list(lines)
    rng, sample = random.Random(seed), []
    for i, line in enumerate(lines):
        if i < size:
            sample.append(line)
        elif (j := rng.randrange(i + 1)) < size:
            sample[j] = line
    return sample


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parses and validates the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="text or JSONL files")
    parser.add_argument(
        "--json-keys", nargs="+", default=None, help="treat inputs as JSONL, use these keys"
    )
    parser.add_argument("--model-prefix", required=True, help="output prefix for .model/.vocab")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument(
        "--input-sentence-size", type=int, default=2_000_000, help="max lines sampled (0 = all)"
    )
    parser.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=1234, help="seed for line sampling")
    args = parser.parse_args(argv)
    for path in args.input:
        if not os.path.isfile(path):
            parser.error(f"--input: file not found: {path}")
    if args.input_sentence_size < 0:
        parser.error(f"--input-sentence-size: must be >= 0, got {args.input_sentence_size}")
    out_dir = os.path.dirname(os.path.abspath(args.model_prefix))
    if not os.path.isdir(out_dir):
        parser.error(f"--model-prefix: directory not found: {out_dir}")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point: trains the model and prints where it was written."""
    args = parse_args(argv)
    try:
        lines = _sample(
            _iter_lines(args.input, args.json_keys), args.input_sentence_size, args.seed
        )
    except ValueError as e:
        sys.exit(f"error: {e}")
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_prefix=args.model_prefix,
            model_type="bpe",
            vocab_size=args.vocab_size,
            byte_fallback=True,
            pad_id=0,
            unk_id=1,
            bos_id=2,
            eos_id=3,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=1 << 16,
            num_threads=args.num_threads,
            minloglevel=1,
        )
    except RuntimeError as e:
        sys.exit(f"error: sentencepiece training failed: {e}")
    prefix = args.model_prefix
    print(f"wrote {prefix}.model and {prefix}.vocab ({len(lines)} lines, vocab {args.vocab_size})")


if __name__ == "__main__":
    main()
