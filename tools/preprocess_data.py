"""Tokenizes a JSON-lines corpus into megatron-core indexed datasets (.bin/.idx).

Example::

    python tools/preprocess_data.py --input data/corpus.jsonl \
        --output-prefix data/corpus --tokenizer-type SentencePieceTokenizer \
        --tokenizer-model data/spm8k.model --append-eod --workers 8

For each ``--json-keys`` key writes ``{output_prefix}_{key}_document.bin/.idx``,
one document (one sequence) per JSON line; lines whose text tokenizes to nothing
are skipped, and ``{output_prefix}_{key}_document.tokenizer.json``: the tokenizer's
type, model file, its sha256 and vocabulary size, which training checks. Outputs
are built under temporary names and renamed into place at the end (the .idx
last), so an interrupted run never leaves a partial file under the final names.
"""

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from megatron_dilocox.platform import cpu  # noqa: E402

cpu.quiet_fallback_warnings()  # before megatron-core announces, at import, what it falls back on
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402

from megatron_dilocox.checkpoint.files import write_atomic  # noqa: E402
from megatron_dilocox.data.tokenizer import IDENTITY_SUFFIX, TOKENIZER_TYPES, build_tokenizer  # noqa: E402

_worker_tokenizer = None
_worker_args = None

# A worker result: (line number, error message or None, {key: token ids}, text bytes).
_Encoded = Tuple[int, Optional[str], Dict[str, List[int]], int]


def _init_worker(args: argparse.Namespace) -> None:
    """Pool initializer: builds the tokenizer once per worker process."""
    global _worker_tokenizer, _worker_args
    _worker_args = args
    _worker_tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)


def _encode(numbered_line: Tuple[int, str]) -> _Encoded:
    """Tokenizes the requested keys of one JSON line (blank lines give no keys)."""
    lineno, line = numbered_line
    if not line.strip():
        return lineno, None, {}, 0
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return lineno, f"invalid JSON: {e.msg}", {}, 0
    ids, nbytes = {}, 0
    for key in _worker_args.json_keys:
        text = record.get(key) if isinstance(record, dict) else None
        if not isinstance(text, str):
            return lineno, f"no string value for JSON key {key!r}", {}, 0
        try:
            ids[key] = _worker_tokenizer.tokenize(text)
        except ValueError as e:  # e.g. NullTokenizer given non-integer text
            return lineno, f"cannot tokenize JSON key {key!r}: {e}", {}, 0
        if _worker_args.append_eod and ids[key]:
            ids[key].append(_worker_tokenizer.eod)
        nbytes += len(text.encode("utf-8"))
    return lineno, None, ids, nbytes


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parses the command line; a missing input file is a one-line ``parser.error``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="JSON-lines file")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize")
    parser.add_argument("--output-prefix", required=True, help="prefix of the output files")
    parser.add_argument(
        "--tokenizer-type", default="SentencePieceTokenizer", help=", ".join(TOKENIZER_TYPES)
    )
    parser.add_argument("--tokenizer-model", default=None, help="SentencePiece .model file")
    parser.add_argument("--vocab-size", type=int, default=None, help="vocab size (NullTokenizer)")
    parser.add_argument("--append-eod", action="store_true", help="end each document with eod")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--log-interval", type=int, default=1000, help="docs per progress line")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.input):
        parser.error(f"--input: file not found: {args.input}")
    if args.workers < 1:
        parser.error(f"--workers: must be >= 1, got {args.workers}")
    return args


def _replace_outputs(tmp_prefix: str, final_prefix: str, identity: dict) -> None:
    """Moves ``tmp_prefix``.bin/.idx to ``final_prefix`` and writes the tokenizer record there;
    the old .idx and record go first, the new .idx last.

    Removing the old index first means a crash in between leaves no valid-looking pair.
    """
    for ext in (".idx", IDENTITY_SUFFIX):
        if os.path.exists(final_prefix + ext):
            os.remove(final_prefix + ext)
    os.replace(tmp_prefix + ".bin", final_prefix + ".bin")
    write_atomic(final_prefix + IDENTITY_SUFFIX, json.dumps(identity, indent=1).encode())
    os.replace(tmp_prefix + ".idx", final_prefix + ".idx")


def _log_progress(docs: int, nbytes: int, start: float, final: bool = False) -> None:
    elapsed = max(time.time() - start, 1e-9)
    print(
        f"{'done' if final else 'processed'}: {docs} documents in {elapsed:.1f}s "
        f"({docs / elapsed:.1f} docs/s, {nbytes / elapsed / 1e6:.2f} MB/s)",
        file=sys.stderr,
        flush=True,
    )


def _write_documents(args: argparse.Namespace, builders: Dict[str, IndexedDatasetBuilder]) -> str:
    """Tokenizes every line of ``args.input`` into ``builders``; returns a summary line.

    Raises:
        SystemExit: On a malformed line, naming the file and line number.
    """
    docs = skipped = tokens = nbytes = 0
    start = time.time()
    with open(args.input, encoding="utf-8") as f, contextlib.ExitStack() as stack:
        numbered = enumerate(f, 1)
        if args.workers == 1:
            _init_worker(args)
            results = map(_encode, numbered)
        else:
            pool = stack.enter_context(multiprocessing.Pool(args.workers, _init_worker, (args,)))
            results = pool.imap(_encode, numbered, chunksize=64)
        try:
            for lineno, error, ids, size in results:
                if error:
                    sys.exit(f"error: {args.input}:{lineno}: {error}")
                if not ids:
                    continue
                if not all(ids.values()):
                    skipped += 1
                    continue
                for key, doc_ids in ids.items():
                    builders[key].add_document(doc_ids, [len(doc_ids)])
                    tokens += len(doc_ids)
                docs += 1
                nbytes += size
                if docs % args.log_interval == 0:
                    _log_progress(docs, nbytes, start)
        except UnicodeDecodeError:
            sys.exit(f"error: {args.input}: not UTF-8 text")
    _log_progress(docs, nbytes, start, final=True)
    return f"{docs} documents, {tokens} tokens, skipped {skipped} empty"


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point: tokenizes ``--input`` and writes one indexed dataset per JSON key."""
    args = parse_args(argv)
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    except ValueError as e:
        sys.exit(f"error: {e}")
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)

    finals = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    tmps = {key: f"{final}.tmp{os.getpid()}" for key, final in finals.items()}
    builders = {key: IndexedDatasetBuilder(tmps[key] + ".bin", dtype=dtype) for key in tmps}
    try:
        summary = _write_documents(args, builders)
        for key, builder in builders.items():
            builder.finalize(tmps[key] + ".idx")
        for key in finals:
            _replace_outputs(tmps[key], finals[key], tokenizer.identity)
    finally:
        for key, builder in builders.items():
            builder.data_file.close()
            for path in (tmps[key] + ".bin", tmps[key] + ".idx"):
                if os.path.exists(path):
                    os.remove(path)
    outputs = ", ".join(f"{final}.bin/.idx" for final in finals.values())
    print(f"wrote {summary} ({dtype.__name__} ids): {outputs}")


if __name__ == "__main__":
    main()
