"""Builds a real-text corpus from the Python installation itself, needing no download.

Three sources (``SOURCES``), each extending the one before, so that its output is a
prefix of the next one's:

- ``stdlib-docs``: the English prose every Python installation ships: module, class
  and function docstrings, explanatory comments, the language reference topics that
  ``pydoc`` serves (``pydoc_data/topics.py``) and the license/readme files; one
  document per source file (or per pydoc topic).
- ``stdlib``: plus the standard library's Python source files, whole, one document each.
- ``stdlib+site-packages``: plus the ``.py`` files of the installed packages
  (``sysconfig``'s purelib/platlib directories), whole, one document each; of the installed
  distributions only those named in ``corpus_distributions.txt`` are read (files that belong to
  no distribution are read too), so that a newly added dependency leaves the corpus as it is.

Files are visited in sorted path order, Python files are decoded as the interpreter
decodes them (PEP 263 cookies, universal newlines) and the output is UTF-8 with ``\\n``
line ends, so the same Python version and the same installed packages give a
byte-identical corpus. The two stdlib sources depend only on the Python version; the
site-packages part depends on the listed distributions' versions (constraints-cpu.txt pins
them; :func:`distribution_mismatches` names those installed at other versions). Exact duplicate documents
are written once, so no document can land on both sides of megatron's document-level
train/validation split.
"""

import ast
import hashlib
import importlib.metadata
import json
import os
import random
import re
import sysconfig
import tokenize
from itertools import chain, islice
from typing import Callable, Collection, Iterator, List, Optional, Sequence, Set

SOURCES = ("stdlib-docs", "stdlib", "stdlib+site-packages")
"""The corpus choices, smallest first (see the module docstring)."""

MIN_DOC_CHARS = 200
"""Documents shorter than this many characters are skipped."""

MAX_SOURCE_BYTES = 1_000_000
"""Python files larger than this many bytes are not taken whole: at that size they are
generated tables or vendored bundles rather than written code."""

MAX_LINE_CHARS = 1_000
"""Python files with a line longer than this many characters are not taken whole: such
lines are generated (minified code, embedded data or base64 blobs)."""

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
_DISTRIBUTIONS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus_distributions.txt")
_SUFFIXES = (".py", ".txt", ".rst")
_PREFIXES = ("LICENSE", "README")
_PYDOC_TOPICS = "pydoc_data/topics.py"


def _source_files(
    root: str, skip_dirs: Collection[str], wanted: Callable[[str], bool]
) -> List[str]:
    """Lists the files under ``root`` whose names are ``wanted`` as sorted POSIX relative paths.

    Directories named in ``skip_dirs`` or starting with ``config-`` are not entered.
    """
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith("config-")]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            if wanted(name):
                found.append(os.path.normpath(os.path.join(rel_dir, name)).replace(os.sep, "/"))
    return sorted(found)


def _is_prose_file(name: str) -> bool:
    """Whether a stdlib file feeds the ``stdlib-docs`` part (Python, text, license, readme)."""
    return name.endswith(_SUFFIXES) or name.startswith(_PREFIXES)


def _is_code_file(name: str) -> bool:
    """Whether a file is taken whole as Python source.

    pip's editable-install finders (``__editable__*``) are left out: they hold absolute
    paths of the checkout, which would make the corpus depend on where it lives.
    """
    return name.endswith(".py") and not name.startswith("__editable__")


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


def _whole_source(path: str) -> Optional[str]:
    """Returns a Python file's text, or None if unreadable or over the size/line limits."""
    try:
        if os.path.getsize(path) > MAX_SOURCE_BYTES:
            return None
        with tokenize.open(path) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError, SyntaxError):
        return None
    if any(len(line) > MAX_LINE_CHARS for line in text.splitlines()):
        return None
    return text


def _prose_documents(root: str) -> Iterator[str]:
    """Yields the ``stdlib-docs`` documents of the standard library at ``root``."""
    for rel_path in _source_files(root, _SKIP_DIRS, _is_prose_file):
        yield from _file_documents(os.path.join(root, rel_path), rel_path)


def _code_documents(root: str, skip_dirs: Collection[str], skip_files: Collection[str] = ()) -> Iterator[str]:
    """Yields the Python files under ``root`` whole (those within the limits), but ``skip_files``
    (POSIX paths relative to ``root``)."""
    for rel_path in _source_files(root, skip_dirs, _is_code_file):
        if rel_path in skip_files:
            continue
        text = _whole_source(os.path.join(root, rel_path))
        if text is not None:
            yield text


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def corpus_distributions() -> dict:
    """The distributions the site-packages part reads: {normalized name: pinned version}."""
    with open(_DISTRIBUTIONS_FILE, encoding="utf-8") as f:
        pins = [line.strip().split("==") for line in f if line.strip() and not line.startswith("#")]
    return {_normalized(name): version for name, version in pins}


def _installed(site: str) -> List[importlib.metadata.Distribution]:
    return list(importlib.metadata.distributions(path=[site]))


def _unlisted_files(site: str) -> Set[str]:
    """Files under ``site`` that belong to installed distributions not in the corpus list."""
    listed = corpus_distributions()
    return {os.path.normpath(str(f)).replace(os.sep, "/") for d in _installed(site)
            if _normalized(d.metadata["Name"]) not in listed for f in d.files or ()}


def distribution_mismatches(site_dirs: Optional[Sequence[str]] = None) -> List[str]:
    """The listed distributions installed at another version than the pinned corpus read, or
    missing: one line each ("name: installed X, the corpus list says Y")."""
    listed, found = corpus_distributions(), {}
    for site in site_packages_dirs() if site_dirs is None else site_dirs:
        found.update({_normalized(d.metadata["Name"]): d.version for d in _installed(site)})
    return [f"{name}: installed {found.get(name, 'nothing')}, the corpus list says {version}"
            for name, version in sorted(listed.items()) if found.get(name) != version]


def site_packages_dirs() -> List[str]:
    """Returns this interpreter's installed-package directories (purelib, platlib), sorted."""
    paths = sysconfig.get_paths()
    return sorted({paths["purelib"], paths["platlib"]})


def iter_documents(
    source: str = "stdlib-docs",
    stdlib_dir: Optional[str] = None,
    site_dirs: Optional[Sequence[str]] = None,
) -> Iterator[str]:
    """Returns the corpus documents of one source choice in deterministic order.

    Args:
        source: One of ``SOURCES``.
        stdlib_dir: Root of the standard library; defaults to
            ``sysconfig.get_paths()["stdlib"]``.
        site_dirs: Installed-package directories read by ``stdlib+site-packages``;
            defaults to ``site_packages_dirs()``.

    Returns:
        An iterator over the document texts, stripped, of at least ``MIN_DOC_CHARS``
        characters, each text once.

    Raises:
        ValueError: On an unknown ``source``.
    """
    if source not in SOURCES:
        raise ValueError(f"unknown corpus source {source!r}, choose from {', '.join(SOURCES)}")
    root = stdlib_dir or sysconfig.get_paths()["stdlib"]
    parts = [_prose_documents(root)]
    if source != "stdlib-docs":
        parts.append(_code_documents(root, _SKIP_DIRS))
    if source == "stdlib+site-packages":
        dirs = site_packages_dirs() if site_dirs is None else site_dirs
        parts.extend(_code_documents(site, {"__pycache__"}, _unlisted_files(site)) for site in dirs)
    return _distinct(chain.from_iterable(parts))


def _distinct(documents: Iterator[str]) -> Iterator[str]:
    """Yields the stripped documents of at least ``MIN_DOC_CHARS`` characters, each text once."""
    seen: Set[bytes] = set()
    for doc in documents:
        doc = doc.strip()
        if len(doc) < MIN_DOC_CHARS:
            continue
        digest = hashlib.sha256(doc.encode("utf-8")).digest()
        if digest not in seen:
            seen.add(digest)
            yield doc


def build_corpus(
    output_jsonl: str,
    source: str = "stdlib-docs",
    max_docs: Optional[int] = None,
    stdlib_dir: Optional[str] = None,
    site_dirs: Optional[Sequence[str]] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    shuffle_seed: Optional[int] = None,
) -> int:
    """Writes a corpus as JSON lines ``{"text": ...}`` (UTF-8, ``\\n`` line ends).

    The file is written under a temporary name in the same directory and renamed
    into place, so ``output_jsonl`` is either absent, the old file, or complete.

    Args:
        output_jsonl: Destination path; parent directories are created.
        source: One of ``SOURCES``.
        max_docs: Stop after this many documents (all documents when None).
        stdlib_dir: As for ``iter_documents``.
        site_dirs: As for ``iter_documents``.
        progress: Called after each document with the documents and bytes written so far.
        shuffle_seed: Write the documents in an order permuted with this seed (after
            ``max_docs``), so that a contiguous document split such as megatron's ``--split``
            takes a uniform sample; None: path order (each source's file then extends the last).

    Returns:
        The number of documents written.

    Raises:
        ValueError: On an unknown ``source``.
    """
    documents = islice(iter_documents(source, stdlib_dir, site_dirs), max_docs)
    if shuffle_seed is not None:
        documents = list(documents)
        random.Random(shuffle_seed).shuffle(documents)
    out_dir = os.path.dirname(os.path.abspath(output_jsonl))
    os.makedirs(out_dir, exist_ok=True)
    tmp_path = f"{output_jsonl}.tmp{os.getpid()}"
    count = nbytes = 0
    try:
        with open(tmp_path, "wb") as f:
            for doc in documents:
                line = (json.dumps({"text": doc}, ensure_ascii=False) + "\n").encode("utf-8")
                f.write(line)
                count, nbytes = count + 1, nbytes + len(line)
                if progress is not None:
                    progress(count, nbytes)
        os.replace(tmp_path, output_jsonl)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
    return count
