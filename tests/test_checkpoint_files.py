"""The save directory on disk, without a training run: one owner at a time, a manifest that covers
every file and is itself covered by a digest, retention (test_checkpoint.py runs them for real)."""

import json
import socket
import subprocess

import pytest

from megatron_dilocox.checkpoint import files
from megatron_dilocox.errors import CheckpointError


def _save(root, iteration, extra=None):
    """A checkpoint of two small files, published as the training code does."""
    partial = files.start(root, iteration)
    (partial / "ranks").mkdir()
    (partial / "ranks" / "r0.pt").write_bytes(b"rank state %d" % iteration)
    (partial / "model.bin").write_bytes(b"weights")
    listed = files.describe_files(partial, files.list_files(partial))
    if extra:
        (partial / extra).write_bytes(b"someone else's")
    return files.publish(root, iteration, {"iteration": iteration}, listed)


def _write_lock(root, host, pid):
    root.mkdir(exist_ok=True)
    (root / files.LOCK).write_text(json.dumps({"host": host, "pid": pid, "started": "2024-01-01T00:00:00"}))


def test_a_save_directory_has_one_owner(tmp_path):
    root = tmp_path / "ckpt"
    assert files.lock(root) is None and files.lock(root) is None  # created; this process already owns it
    owner = json.loads((root / files.LOCK).read_text())
    assert owner["host"] == socket.gethostname() and owner["pid"] > 0 and owner["started"]
    files.unlock(root)
    assert not (root / files.LOCK).exists()

    with subprocess.Popen(["sleep", "60"]) as alive:
        _write_lock(root, socket.gethostname(), alive.pid)
        with pytest.raises(CheckpointError, match=rf"run\.lock: --save directory in use by another run "
                                                  rf"\(host {socket.gethostname()}, pid {alive.pid}, started 2024"):
            files.lock(root)
        files.unlock(root)  # not ours: stays
        assert json.loads((root / files.LOCK).read_text())["pid"] == alive.pid
        alive.kill()
    _write_lock(root, "elsewhere", alive.pid)  # gone, but on a host this process cannot check
    with pytest.raises(CheckpointError, match="host elsewhere"):
        files.lock(root)

    dead = subprocess.Popen(["true"])
    dead.wait()
    _write_lock(root, socket.gethostname(), dead.pid)
    warning = files.lock(root)
    assert f"took over the lock of a run that is gone (host {socket.gethostname()}, pid {dead.pid}" in warning
    assert json.loads((root / files.LOCK).read_text())["pid"] != dead.pid
    assert sorted(p.name for p in root.iterdir()) == [files.LOCK]  # no temporary files left


def test_the_manifest_lists_every_file_and_is_covered_by_its_digest(tmp_path):
    folder = _save(tmp_path, 4)
    manifest = files.read_manifest(folder)
    assert sorted(manifest["files"]) == ["model.bin", "ranks/r0.pt"] and manifest["iteration"] == 4
    files.check_listed(folder, manifest)
    assert (folder / files.DIGEST).read_text().endswith(f"  {files.MANIFEST}\n")

    (folder / "ranks" / "stray.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"iter_0000004/ranks/stray\.distcp: not listed in the manifest"):
        files.check_listed(folder, manifest)
    assert files.unlisted(folder, manifest) == ["ranks/stray.distcp"]

    path = folder / files.MANIFEST
    path.write_text(path.read_text().replace('"iteration": 4', '"iteration": 5'))
    with pytest.raises(CheckpointError, match=r"iter_0000004/manifest\.json: sha256 differs from manifest\.json\.sha256"):
        files.read_manifest(folder)
    (folder / files.DIGEST).unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json\.sha256: missing"):
        files.read_manifest(folder)


def test_a_file_that_appears_while_saving_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"iter_0000002\.partial/__0_0\.distcp: appeared while saving"):
        _save(tmp_path, 2, extra="__0_0.distcp")
    assert not files.iteration_dir(tmp_path, 2).exists() and not (tmp_path / files.TRACKER).exists()


def test_retention_keeps_the_newest_and_the_tracked(tmp_path):
    assert not files.has_checkpoint(tmp_path)
    for iteration in (1, 2, 3):
        _save(tmp_path, iteration)
    assert files.has_checkpoint(tmp_path)
    assert files.prune(tmp_path, 2) == [files.iteration_dir(tmp_path, 1)]
    for iteration in (4, 5):
        _save(tmp_path, iteration)
    (tmp_path / files.TRACKER).write_text("2\n")  # e.g. moved back by hand
    assert files.prune(tmp_path, 2) == [files.iteration_dir(tmp_path, 3)]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["iter_0000002", "iter_0000004", "iter_0000005"]
    assert files.latest(tmp_path) == files.iteration_dir(tmp_path, 2)
    # A folder without a manifest is not ours (Megatron-LM's iterations beside ours): never deleted.
    foreign = files.iteration_dir(tmp_path, 0)
    foreign.mkdir()
    (foreign / files.FOREIGN_DIST_METADATA).write_text('{"sharded_backend": "torch_dist"}')
    assert files.prune(tmp_path, 1) == [files.iteration_dir(tmp_path, 4)] and foreign.is_dir()
    with pytest.raises(CheckpointError, match=r"iter_0000000: a Megatron-LM distributed checkpoint \(it has metadata\.json, "
                                              r"no manifest\.json\): no checksums to check; pretrain_gpt\.py --load"):
        files.read_manifest(foreign)
