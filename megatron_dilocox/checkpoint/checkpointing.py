"""Saving and loading training checkpoints (the layout on disk is in :mod:`.files`).

A checkpoint has two parts:

* ``model/``: the global weights (under DiLoCoX: the outer parameters with the in-flight
  round applied, as the run would end now; identical in every cluster), written with megatron-core's ``dist_checkpointing``, so they load into any TP/PP
  layout and any number of clusters;
* ``ranks/``: one file per rank with everything an exact resume needs: the inner optimizer's
  fp32 main params and Adam state, RNG states, the running loss window and the DiLoCoX state
  (outer params, round start, outer momentum, the reduced result of the in-flight round, the
  compressor's warm starts and residuals, H) and the cross-cluster byte tallies. Used when the
  layout is unchanged.

Loading with another layout (or from a converted checkpoint, which has no ``ranks/``) restores
the weights, the iteration and the learning-rate schedule; the inner optimizer and the outer
state start fresh from those weights, and the log says so.

A run owns its ``--save`` directory from start to exit (:func:`lock_save_dir`).

This package never imports ``training/``. What it saves and restores is plain dicts, the
trainer's state dict (its ``eval_round`` and ``scheduler`` go into the manifest, the entries
named in :data:`RANK_STATE` into the rank's file), and megatron's sharded state dicts, through
the adapter below both (:mod:`megatron_dilocox.megatron_state`). The entry point's layer
(``megatron_dilocox/job.py``) wires the two.
"""

import atexit
import dataclasses
import io
import json
import random
import sys
import time
from pathlib import Path

import numpy
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel

from megatron_dilocox.checkpoint import files, megatron_lm
from megatron_dilocox.errors import CheckpointError
from megatron_dilocox.megatron_state import model_sharded_state_dict, unwrap
from megatron_dilocox.platform.backend import on_cuda
from megatron_dilocox.run_config import RunConfig

# The flags that define the weights' shapes and meaning: a checkpoint loads only where they agree.
MODEL_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "position_embedding_type", "rotary_base", "max_position_embeddings", "normalization", "swiglu",
               "untie_embeddings_and_output_weights", "disable_bias_linear", "padded_vocab_size")


def model_signature(run: RunConfig) -> dict:
    values = {**dataclasses.asdict(run.model), "num_query_groups": run.model.query_groups,
              "padded_vocab_size": run.padded_vocab_size}
    return {flag: values[flag] for flag in MODEL_FLAGS}


def layout(run: RunConfig, topo) -> dict:
    """What must be unchanged for an exact resume from the per-rank files."""
    parallel = run.parallel
    return {"tensor_model_parallel_size": parallel.tensor_model_parallel_size,
            "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
            "virtual_pipeline_model_parallel_size": run.virtual_pipeline_model_parallel_size,
            "world_size": dist.get_world_size(),
            "dilocox_clusters": topo.clusters if run.dilocox else 0,
            "use_distributed_optimizer": parallel.use_distributed_optimizer,
            "bf16": run.training.bf16}


def coordinates(run: RunConfig, topo) -> dict:
    return {"cluster": topo.cluster_rank if run.dilocox else 0,
            "tp": parallel_state.get_tensor_model_parallel_rank(),
            "pp": parallel_state.get_pipeline_model_parallel_rank(),
            "dp": topo.inner_dp_rank}


# The entries of the trainer's state dict that go into the per-rank file (the others, its
# ``eval_round`` and ``scheduler``, into the manifest).
RANK_STATE = ("main_params", "optimizers", "window_loss", "dilocox", "audit")
ADDED_RANK_STATE = {"audit": None}
"""Entries of :data:`RANK_STATE` that checkpoints written before them lack: restored as this value."""


def _rng_state() -> dict:
    np_state = numpy.random.get_state()
    return {"python": random.getstate(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if on_cuda() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    numpy.random.set_state((kind, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and on_cuda():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _warn(message: str) -> None:
    """One warning line for the whole job (from rank 0)."""
    if dist.get_rank() == 0:
        print(f"WARNING: {message}", file=sys.stderr, flush=True)


def _all_ranks_ok(error: str | None) -> None:
    """Raises on every rank the first error any rank found, so no rank waits on the others."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


# -- save ----------------------------------------------------------------------------------------


def lock_save_dir(root) -> None:
    """Makes this run the owner of save directory ``root`` until its process exits; a second run
    is refused, a stale lock left by a dead process on this host taken over (collective: rank 0
    holds the lock)."""
    error = None
    if dist.get_rank() == 0:
        try:
            warning = files.lock(root)
        except CheckpointError as err:
            error = str(err)
        except OSError as err:
            error = f"--save {root}: cannot create the lock file: {err.strerror}"
        else:
            atexit.register(files.unlock, root)
            if warning:
                _warn(warning)
    _all_ranks_ok(error)


def _described(run: RunConfig) -> dict:
    """Manifest fields every checkpoint has: the model's flags, all flags, the time."""
    return {"model": model_signature(run), "args": json.loads(json.dumps(run.flat(), default=str)),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _metadata(run: RunConfig, topo, iteration: int, state: dict) -> dict:
    dilocox = None
    if state["dilocox"] is not None:
        outer = state["dilocox"]
        dilocox = {"outer_step": outer["sync"]["outer_step"], "sync_mode": run.outer.sync_mode,
                   "compression": run.compression.codec, "local_steps": outer["local_steps"],
                   "next_boundary": outer["next_boundary"]}
    batch = run.training.global_batch_size
    return {"kind": "training", "iteration": iteration, "eval_round": state["eval_round"],
            "consumed_samples": iteration * batch,
            "global_batch_size": batch, "scheduler": state["scheduler"],
            "layout": layout(run, topo), "dilocox": dilocox, **_described(run)}


def _rank_state(run: RunConfig, topo, iteration: int, state: dict) -> dict:
    return {"iteration": iteration, "coordinates": coordinates(run, topo), "rng": _rng_state(),
            **{key: state[key] for key in RANK_STATE}}


def _write_collectively(root, iteration: int, metadata: dict, write, keep: int = -1) -> Path:
    """Every rank calls ``write(folder)`` into a fresh ``.partial`` folder; then the files are
    hashed (a share per rank) and rank 0 publishes them with the manifest and, with ``keep`` > 0,
    deletes all but the last ``keep`` checkpoints."""
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = files.partial_dir(root, iteration)
    if rank == 0:
        files.start(root, iteration)
        (folder / "ranks").mkdir()
        (folder / "model").mkdir()
    dist.barrier()
    write(folder)
    dist.barrier()
    listing = [files.list_files(folder) if rank == 0 else None]
    dist.broadcast_object_list(listing, src=0)
    described = [None] * world
    dist.all_gather_object(described, files.describe_files(folder, listing[0][rank::world]))
    error = None
    if rank == 0:
        everything = {name: info for part in described for name, info in part.items()}
        try:
            files.publish(root, iteration, metadata, everything)
        except CheckpointError as err:
            error = str(err)
        else:
            if keep > 0:
                files.prune(root, keep)
    _all_ranks_ok(error)
    return files.iteration_dir(root, iteration)


def save(run: RunConfig, topo, iteration: int, state: dict, weights) -> Path:
    """Writes the training checkpoint of ``iteration`` to ``--save`` (collective: every rank
    calls it).

    ``state``: the trainer's state dict (references to live tensors: it is serialized before
    ``weights`` is entered); ``weights()``: a context manager yielding megatron's sharded state
    dict of the weights to keep, valid while it is open (under DiLoCoX it swaps in the global
    parameters).
    """
    def write(folder):
        rank_state = _rank_state(run, topo, iteration, state)
        buffer = io.BytesIO()
        torch.save(rank_state, buffer)
        files.write_atomic(folder / files.rank_file(rank_state["coordinates"]), buffer.getbuffer())
        with weights() as sharded_state_dict:
            dist_checkpointing.save(sharded_state_dict, str(folder / "model"))

    return _write_collectively(run.checkpoint.save, iteration, _metadata(run, topo, iteration, state), write,
                               run.checkpoint.most_recent_k)


def save_weights(model, run: RunConfig, root, source: str) -> Path:
    """A weights-only checkpoint at iteration 0 (e.g. converted from another format); it loads
    into any layout like a resharded training checkpoint."""
    metadata = {"kind": "weights", "source": source, "iteration": 0, "eval_round": 0,
                "layout": None, "dilocox": None, **_described(run)}
    lock_save_dir(root)
    return _write_collectively(root, 0, metadata, lambda folder: dist_checkpointing.save(
        model_sharded_state_dict(model), str(folder / "model")))


# -- load ----------------------------------------------------------------------------------------


def open_folder(folder, rank: int = 0, world: int = 1) -> dict:
    """The manifest of checkpoint folder ``folder``: Megatron-LM's (made from its args), or ours,
    checked against its digest, its files verified (by ``world`` callers, a share each) and, by
    rank 0, none unlisted."""
    if megatron_lm.is_checkpoint(folder):
        return megatron_lm.read_manifest(folder)
    manifest = files.read_manifest(folder)
    if rank == 0:
        files.check_listed(folder, manifest)
    files.verify(folder, manifest, sorted(manifest["files"])[rank::world])
    return manifest


def _is_folder(path) -> bool:
    """Whether ``path`` is one checkpoint folder itself (``iter_N/``, ours or Megatron-LM's)."""
    return (Path(path) / files.MANIFEST).is_file() or megatron_lm.is_checkpoint(path)


def tracked_folder(root) -> Path:
    """The checkpoint folder to load from ``root``: the one the tracker of a save directory (ours
    or Megatron-LM's) points at, or ``root`` itself when it is one."""
    if _is_folder(root):
        return Path(root)
    return megatron_lm.tracked_folder(root) or files.latest(root)


def load_weights(model, folder) -> None:
    """Reads a checkpoint's global weights into this rank's model chunks, whatever its layout
    (ours keep them in ``model/``; a Megatron-LM iteration folder is the distributed checkpoint)."""
    weights = Path(folder) if megatron_lm.is_checkpoint(folder) else Path(folder) / "model"
    loaded = dist_checkpointing.load(model_sharded_state_dict(model), str(weights))
    for i, chunk in enumerate(model):
        unwrap(chunk).load_state_dict(loaded[f"model{i}"])


def _check_compatible(manifest: dict, path, run: RunConfig) -> None:
    saved, wanted = manifest["model"], model_signature(run)
    for flag in MODEL_FLAGS:
        if saved.get(flag) != wanted[flag]:
            name = "padded vocabulary size" if flag == "padded_vocab_size" else "--" + flag.replace("_", "-")
            raise CheckpointError(f"{path}: model mismatch: {name} is {saved.get(flag)} in the checkpoint, "
                                  f"{wanted[flag]} in this run")
    batch = run.training.global_batch_size
    if manifest["iteration"] > 0 and manifest["global_batch_size"] != batch:
        raise CheckpointError(f"{path}: --global-batch-size is {manifest['global_batch_size']} in the checkpoint, "
                              f"{batch} in this run (the data position counts global batches)")


class Resume:
    """A verified checkpoint about to be loaded (collective: every rank constructs it).

    Call :meth:`load_weights` on the wrapped model before the optimizer is built, then
    :meth:`restore` with the trainer's ``load_state_dict``.
    """

    @classmethod
    def find(cls, run: RunConfig, topo) -> "Resume | None":
        """The checkpoint in ``--load`` to resume from; None, with one warning, when that directory
        holds none yet (as in Megatron-LM, so a first launch with ``--save X --load X`` starts from
        scratch). ``--load`` may also name one checkpoint folder (``iter_N/``)."""
        if files.has_checkpoint(run.checkpoint.load) or _is_folder(run.checkpoint.load):
            return cls(run, topo)
        _warn(f"--load {run.checkpoint.load}: no checkpoint there yet (no {files.TRACKER}); starting from scratch")
        return None

    def __init__(self, run: RunConfig, topo):
        rank, world = dist.get_rank(), dist.get_world_size()
        error = None
        try:
            self.folder = tracked_folder(run.checkpoint.load)
            self.manifest = open_folder(self.folder, rank, world)
            _check_compatible(self.manifest, self.folder / files.MANIFEST, run)
        except CheckpointError as err:
            error = str(err)
        _all_ranks_ok(error)
        self.iteration = int(self.manifest["iteration"])
        self.rank_file = files.rank_file(coordinates(run, topo))
        exact = self.manifest.get("layout") == layout(run, topo) and self.rank_file in self.manifest["files"]
        everyone = [None] * world
        dist.all_gather_object(everyone, exact)
        if len(set(everyone)) != 1:
            raise CheckpointError(f"{self.folder}: per-rank files exist for some ranks of this layout only")
        self.exact = exact
        self.dilocox = run.dilocox

    def describe(self) -> str:
        saved = self.manifest.get("layout")
        origin = "a Megatron-LM checkpoint" if self.manifest.get("kind") == "megatron-lm" else "a converted checkpoint"
        how = ("exact resume" if self.exact else
               "weights only (resharded from "
               + (f"TP={saved['tensor_model_parallel_size']} PP={saved['pipeline_model_parallel_size']}, "
                  f"{saved['world_size']} ranks" if saved else origin)
               + "); the inner optimizer" + (" and the outer state start" if self.dilocox else " starts")
               + " fresh from them")
        return f"> loading {self.folder} (iteration {self.iteration}): {how}"

    def load_weights(self, model) -> None:
        """Weights-only path: reads the global weights into this layout (no-op for exact resume,
        which restores the main params themselves in :meth:`restore`)."""
        if not self.exact:
            load_weights(model, self.folder)

    def restore(self, load_state_dict) -> None:
        """Hands ``load_state_dict`` the saved iteration, validation position and LR schedule;
        with an exact resume then the rank's state (:data:`RANK_STATE`), and restores the RNG
        states. ``load_state_dict`` raises AssertionError on a schedule mismatch (megatron's),
        ValueError or KeyError on rank state it cannot take."""
        progress = {"iteration": self.iteration, "eval_round": int(self.manifest.get("eval_round", 0))}
        # Megatron-LM's saved with --no-save-optim have no schedule: it follows the iteration.
        if self.iteration > 0 and "scheduler" in self.manifest:
            progress["scheduler"] = self.manifest["scheduler"]
        try:
            load_state_dict(progress)
        except AssertionError as err:  # megatron asserts that the schedule flags agree
            raise CheckpointError(f"{self.folder / files.MANIFEST}: learning-rate schedule mismatch: {err}") from None
        if not self.exact:
            return
        path = self.folder / self.rank_file
        state = torch.load(path, weights_only=True)
        error = None
        try:
            load_state_dict({key: state[key] if key in state or key not in ADDED_RANK_STATE else ADDED_RANK_STATE[key]
                             for key in RANK_STATE})
            _set_rng_state(state["rng"])
        except (ValueError, KeyError) as err:
            error = f"{path}: cannot restore: {err}"
        _all_ranks_ok(error)
