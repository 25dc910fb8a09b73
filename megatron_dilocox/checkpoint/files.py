"""The checkpoint directory on disk: Megatron's layout, atomic publication, checksums.

::

    SAVE_DIR/
      run.lock                             the run saving here: host, pid, start time
      latest_checkpointed_iteration.txt    the iteration to resume from (written last)
      iter_0000020/
        manifest.json                      what the checkpoint is + sha256 and size of every file
        manifest.json.sha256               sha256 of manifest.json (``sha256sum -c`` reads it)
        model/                             global weights (megatron dist_checkpointing, reshardable)
        ranks/c00_tp00_pp000_dp000.pt      exact-resume state of each rank

A save is written into ``iter_0000020.partial/``, published by renaming it once every file is
on disk and listed in the manifest, and only then does the tracker move. A save that dies
half-way leaves a ``.partial`` folder that loading never looks at (the next save of that
iteration removes it), so the previous checkpoint stays the one to load. A checkpoint folder
holding a file its manifest does not list, or whose manifest does not match its digest, is
refused. One run at a time owns a save directory (:func:`lock`).

Nothing here needs torch.distributed: the callers decide which rank does what.
"""

import hashlib
import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

from megatron_dilocox.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
DIGEST = MANIFEST + ".sha256"
LOCK = "run.lock"
NOT_LISTED = "not listed in the manifest (written by another run?)"
FORMAT = "megatron-dilocox/1"
# megatron-core's dist-checkpoint marker: at the top of a Megatron-LM iteration folder (ours keep it in model/).
FOREIGN_DIST_METADATA = "metadata.json"


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
    """Every file under ``directory`` (relative, sorted), the manifest and its digest excepted."""
    directory = Path(directory)
    names = (str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
    return sorted(name for name in names if name not in (MANIFEST, DIGEST))


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
    extra = sorted(set(list_files(partial)) - set(files))
    if extra:
        raise CheckpointError(f"{partial / extra[0]}: appeared while saving (is another run writing to {root}?)")
    manifest = json.dumps({"format": FORMAT, **metadata, "files": files}, indent=1, sort_keys=True).encode()
    write_atomic(partial / MANIFEST, manifest)
    write_atomic(partial / DIGEST, f"{hashlib.sha256(manifest).hexdigest()}  {MANIFEST}\n".encode())
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
    """The manifest of a checkpoint folder, checked against its digest file."""
    path, digest = Path(folder) / MANIFEST, Path(folder) / DIGEST
    if not path.is_file():
        if (Path(folder) / FOREIGN_DIST_METADATA).is_file():
            raise CheckpointError(f"{folder}: a Megatron-LM distributed checkpoint (it has {FOREIGN_DIST_METADATA}, "
                                  f"no {MANIFEST}): no checksums to check; pretrain_gpt.py --load and "
                                  "tools/checkpoint/convert.py read it")
        raise CheckpointError(f"{path}: missing (incomplete checkpoint)")
    if not digest.is_file():
        raise CheckpointError(f"{digest}: missing (the manifest cannot be checked)")
    data = path.read_bytes()
    if digest.read_text().split()[:1] != [hashlib.sha256(data).hexdigest()]:
        raise CheckpointError(f"{path}: sha256 differs from {DIGEST} (edited or corrupted)")
    try:
        manifest = json.loads(data)
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


def unlisted(folder, manifest: dict) -> list[str]:
    """Files in a checkpoint folder that its manifest does not list (e.g. another run's)."""
    return sorted(set(list_files(folder)) - set(manifest["files"]))


def check_listed(folder, manifest: dict) -> None:
    """Raises naming the first file of ``folder`` that the manifest does not list."""
    extra = unlisted(folder, manifest)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"{Path(folder) / extra[0]}: {NOT_LISTED}{more}")


def _published(root: Path) -> list[int]:
    """Iterations of the published checkpoint folders in ``root``, ascending: those with a
    manifest (a folder without one, e.g. Megatron-LM's in the same directory, is not ours)."""
    return sorted(int(p.name[5:]) for p in root.iterdir()
                  if re.fullmatch(r"iter_\d{7}", p.name) and (p / MANIFEST).is_file())


def prune(root, keep: int) -> list[Path]:
    """Deletes all but the ``keep`` checkpoints of the highest iterations, never the one the
    tracker points at (call after a save is published); returns the deleted folders."""
    root = Path(root)
    tracker = root / TRACKER
    current = tracker.read_text().strip() if tracker.is_file() else None
    doomed = [iteration_dir(root, i) for i in _published(root)[:-keep] if str(i) != current]
    for folder in doomed:
        shutil.rmtree(folder)
    return doomed


def has_checkpoint(root) -> bool:
    """Whether ``root`` holds a tracker or a published checkpoint folder (else: nothing saved yet)."""
    root = Path(root)
    return (root / TRACKER).exists() or (root.is_dir() and bool(_published(root)))


def _lock_owner(path: Path) -> dict:
    try:
        owner = json.loads(path.read_text())
        return {"host": str(owner["host"]), "pid": int(owner["pid"]), "started": str(owner["started"])}
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path}: unreadable lock file (delete it if no run uses this directory)") from None


def _is_gone(owner: dict) -> bool:
    """Whether the owner of a lock is known to have exited (only a process on this host can be checked)."""
    if owner["host"] != socket.gethostname():
        return False
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    return False


def lock(root) -> str | None:
    """Makes this process the owner of save directory ``root`` (created if missing).

    Returns:
        None, or a warning to print when a stale lock (its process gone, on this host) was taken over.

    Raises:
        CheckpointError: when another run that may be alive owns it.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path, me = root / LOCK, {"host": socket.gethostname(), "pid": os.getpid(),
                             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    mine = path.with_name(f"{LOCK}.{me['host']}.{me['pid']}")
    write_atomic(mine, json.dumps(me).encode())
    try:
        try:
            os.link(mine, path)  # atomic, and fails if a lock exists
            return None
        except FileExistsError:
            pass
        owner = _lock_owner(path)
        if (owner["host"], owner["pid"]) == (me["host"], me["pid"]):
            return None
        described = f"host {owner['host']}, pid {owner['pid']}, started {owner['started']}"
        if not _is_gone(owner):
            raise CheckpointError(f"{path}: --save directory in use by another run ({described}); "
                                  "use another --save, or delete the lock file if that run is gone")
        os.replace(mine, path)
        return f"{path}: took over the lock of a run that is gone ({described})"
    finally:
        mine.unlink(missing_ok=True)


def unlock(root) -> None:
    """Removes the lock of save directory ``root`` if this process holds it."""
    path = Path(root) / LOCK
    try:
        owner = _lock_owner(path)
    except CheckpointError:
        return
    if (owner["host"], owner["pid"]) == (socket.gethostname(), os.getpid()):
        path.unlink(missing_ok=True)
