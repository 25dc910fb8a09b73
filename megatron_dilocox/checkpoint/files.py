"""The checkpoint directory on disk: Megatron's layout, atomic publication, checksums.

::

    SAVE_DIR/
      latest_checkpointed_iteration.txt    the iteration to resume from (written last)
      iter_0000020/
        manifest.json                      what the checkpoint is + sha256 and size of every file
        model/                             global weights (megatron dist_checkpointing, reshardable)
        ranks/c00_tp00_pp000_dp000.pt      exact-resume state of each rank

A save is written into ``iter_0000020.partial/``, published by renaming it once every file is
on disk and listed in the manifest, and only then does the tracker move. A save that dies
half-way leaves a ``.partial`` folder that loading never looks at (the next save of that
iteration removes it), so the previous checkpoint stays the one to load.

Nothing here needs torch.distributed: the callers decide which rank does what.
"""

import hashlib
import json
import os
import shutil
from pathlib import Path

from megatron_dilocox.arguments import ConfigError

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
FORMAT = "megatron-dilocox/1"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


def iteration_dir(root, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def partial_dir(root, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}.partial"


def rank_file(coordinates: dict) -> str:
    """Relative path of one rank's exact-resume state, named by its place in the layout."""
    c = coordinates
    return f"ranks/c{c['cluster']:02d}_tp{c['tp']:02d}_pp{c['pp']:03d}_dp{c['dp']:03d}.pt"


def write_atomic(path, data) -> None:
    """Writes ``data`` to ``path`` through a temporary name, so readers see all or nothing."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def sha256_file(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def list_files(directory) -> list[str]:
    """Every file under ``directory`` (relative, sorted), the manifest excepted."""
    directory = Path(directory)
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def describe_files(directory, names) -> dict[str, dict]:
    """``{name: {"sha256", "bytes"}}`` for the given files of ``directory``."""
    return {name: {"sha256": sha256_file(Path(directory) / name), "bytes": (Path(directory) / name).stat().st_size}
            for name in names}


def start(root, iteration: int) -> Path:
    """Creates an empty ``.partial`` folder for a new save (one rank calls this)."""
    partial = partial_dir(root, iteration)
    if partial.exists():
        shutil.rmtree(partial)  # left by a save that died
    partial.mkdir(parents=True)
    return partial


def publish(root, iteration: int, metadata: dict, files: dict[str, dict]) -> Path:
    """Writes the manifest into the ``.partial`` folder, renames it to ``iter_XXXXXXX`` (replacing
    an older save of the same iteration) and moves the tracker to it (one rank calls this)."""
    partial, final = partial_dir(root, iteration), iteration_dir(root, iteration)
    manifest = {"format": FORMAT, **metadata, "files": files}
    write_atomic(partial / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old)
    else:
        os.replace(partial, final)
    write_atomic(Path(root) / TRACKER, f"{iteration}\n".encode())
    return final


def latest(root) -> Path:
    """The folder the tracker points at; CheckpointError when there is none."""
    root = Path(root)
    tracker = root / TRACKER
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such directory")
    if not tracker.is_file():
        raise CheckpointError(f"{root}: no {TRACKER} (not a checkpoint directory, "
                              "or no save has completed yet)")
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text[:40]!r}")
    folder = iteration_dir(root, int(text))
    if not folder.is_dir():
        raise CheckpointError(f"{tracker} points at iteration {int(text)} but {folder} does not exist")
    return folder


def read_manifest(folder) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (incomplete checkpoint)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    return manifest


def verify(folder, manifest: dict, names) -> None:
    """Checks the given files against the manifest; raises naming the first bad one."""
    for name in names:
        path = Path(folder) / name
        expected = manifest["files"][name]
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in the manifest)")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"{path}: {size} bytes, the manifest says {expected['bytes']} (truncated?)")
        if sha256_file(path) != expected["sha256"]:
            raise CheckpointError(f"{path}: sha256 differs from the manifest (corrupted or modified)")
