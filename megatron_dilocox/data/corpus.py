"""Builds a real-text corpus from the Python standard library, needing no download.

Every Python installation ships megabytes of English prose: module, class and
function docstrings, explanatory comments, the language reference topics that
``pydoc`` serves (``pydoc_data/topics.py``) and a few license/readme files.
This module collects that text into a JSON-lines corpus, one document per source
file (or per pydoc topic), in sorted path order so that two machines with the
same Python version and layout produce byte-identical output.
"""

import ast
import json
import os
import sysconfig
import tokenize
from itertools import islice
from typing import Iterator, List, Optional, Set

MIN_DOC_CHARS = 200
"""Documents shorter than this many characters are skipped."""

# Directories skipped: third-party packages, build config, caches, the test suite,
# and parts that Linux distributions often split out into optional packages
# (skipping those keeps the corpus identical across installs of one version).
_SKIP_DIRS = frozenset(
    {
        "__pycache__",
        "dist-packages",
        "ensurepip",
        "idlelib",
        "lib2to3",
        "site-packages",
        "test",
        "tests",
        "tkinter",
        "turtledemo",
    }
)
_SUFFIXES = (".py", ".txt", ".rst")
_PREFIXES = ("LICENSE", "README")
_PYDOC_TOPICS = "pydoc_data/topics.py"


def _source_files(root: str) -> List[str]:
    """Lists the corpus source files under ``root`` as sorted POSIX relative paths."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-")]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(_SUFFIXES) or name.startswith(_PREFIXES):
                found.append(os.path.normpath(os.path.join(rel_dir, name)).replace(os.sep, "/"))
    return sorted(found)


def _comment_blocks(lines: List[str], string_lines: Set[int]) -> List[str]:
    """Returns the runs of consecutive full-line comments as one-line paragraphs.

    Args:
        lines: The source lines.
        string_lines: 1-based numbers of lines inside multi-line string literals.
    """
    blocks, current = [], []
    for lineno, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("#") and lineno not in string_lines:
            if stripped.lstrip("#!").strip():
                current.append(stripped.lstrip("#!").strip())
        elif current:
            blocks.append(" ".join(current))
            current = []
    if current:
        blocks.append(" ".join(current))
    # Drop separators, pragmas, encoding cookies and commented-out one-word lines.
    return [b for b in blocks if len(b.split()) >= 3 and "coding" not in b[:20]]


def _module_text(source: str) -> str:
    """Returns a module's docstrings (in source order) followed by its comment paragraphs."""
    tree = ast.parse(source)
    docstrings, string_lines = [], set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and doc.strip():
                docstrings.append((getattr(node, "lineno", 0), doc.strip()))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            string_lines.update(range(node.lineno + 1, node.end_lineno + 1))
    paragraphs = [doc for _, doc in sorted(docstrings)]
    return "\n\n".join(paragraphs + _comment_blocks(source.splitlines(), string_lines))


def _pydoc_topics(source: str) -> List[str]:
    """Returns the language-reference texts of ``pydoc_data/topics.py``, sorted by topic."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "topics":
            topics = ast.literal_eval(node.value)
            return [topics[key] for key in sorted(topics)]
    return []


def _file_documents(path: str, rel_path: str) -> List[str]:
    """Returns the documents extracted from one source file (empty if unreadable)."""
    try:
        if not rel_path.endswith(".py"):
            with open(path, encoding="utf-8") as f:
                return [f.read()]
        with tokenize.open(path) as f:  # honours PEP 263 encoding cookies
            source = f.read()
        if rel_path == _PYDOC_TOPICS:
            return _pydoc_topics(source)
        return [_module_text(source)]
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []


def iter_stdlib_documents(stdlib_dir: Optional[str] = None) -> Iterator[str]:
    """Yields the corpus documents of the standard library in deterministic order.

    Args:
        stdlib_dir: Root of the standard library; defaults to
            ``sysconfig.get_paths()["stdlib"]``.

    Yields:
        Document texts of at least ``MIN_DOC_CHARS`` characters, stripped.
    """
    root = stdlib_dir or sysconfig.get_paths()["stdlib"]
    for rel_path in _source_files(root):
        for doc in _file_documents(os.path.join(root, rel_path), rel_path):
            doc = doc.strip()
            if len(doc) >= MIN_DOC_CHARS:
                yield doc


def build_stdlib_corpus(output_jsonl: str, max_docs: Optional[int] = None) -> int:
    """Writes the standard-library corpus as JSON lines ``{"text": ...}``.

    The file is written under a temporary name in the same directory and renamed
    into place, so ``output_jsonl`` is either absent, the old file, or complete.

    Args:
        output_jsonl: Destination path; parent directories are created.
        max_docs: Stop after this many documents (all documents when None).

    Returns:
        The number of documents written.
    """
    out_dir = os.path.dirname(os.path.abspath(output_jsonl))
    os.makedirs(out_dir, exist_ok=True)
    tmp_path = f"{output_jsonl}.tmp{os.getpid()}"
    count = 0
    try:
        with open(tmp_path, "w", encoding="utf-8") as f:
            for doc in islice(iter_stdlib_documents(), max_docs):
                f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
                count += 1
        os.replace(tmp_path, output_jsonl)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
    return count
