"""Megatron-LM's checkpoints (``pretrain_gpt.py --ckpt-format torch_dist``): read one to train
on from it, write a model in its layout.

::

    SAVE_DIR/
      latest_checkpointed_iteration.txt    the iteration to load, or ``release``
      iter_0000100/  (or release/)         one megatron-core distributed checkpoint
        metadata.json, .metadata, __0_0.distcp ...

The folder holds the model's sharded tensors under the keys our ``model/`` folder uses
(``decoder.layers.self_attention.linear_qkv.weight`` ...), the optimizer's when it was saved,
and the "common" state: ``args`` (the run's argparse namespace), ``iteration``,
``checkpoint_version`` and ``opt_param_scheduler``. megatron-core up to 0.16 keeps the common
state in ``common.pt``, later versions inside the distributed checkpoint; its own reader takes
both.

What carries over is what a weights-only load of ours carries: the weights, the iteration and
the learning-rate schedule (Megatron-LM counts it in samples, this package in iterations). The
optimizer state of Megatron-LM's distributed optimizer is laid out for its own buckets and is
not read: the inner optimizer starts fresh from the weights.
"""

import argparse
import enum
import os
import shutil
from pathlib import Path

from megatron.core import dist_checkpointing

from megatron_dilocox.checkpoint import files
from megatron_dilocox.errors import CheckpointError

RELEASE = "release"
CHECKPOINT_VERSION = 3.0  # what Megatron-LM writes since its torch_dist format exists
# Megatron-LM flags that change the model this package builds, with the value that means "off".
UNBUILT_FEATURES = {"num_experts": None, "qk_layernorm": False, "multi_latent_attention": False,
                    "add_qkv_bias": False, "apply_residual_connection_post_layernorm": False,
                    "apply_layernorm_1p": False, "squared_relu": False, "rotary_percent": 1.0,
                    "rotary_interleaved": False, "mtp_num_layers": None, "heterogeneous_layers_config_path": None}
# The scheduler's entries that Megatron-LM counts in samples.
_SAMPLE_COUNTS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")


def is_checkpoint(folder) -> bool:
    """Whether ``folder`` is a Megatron-LM iteration folder (a distributed checkpoint without our manifest)."""
    folder = Path(folder)
    return (folder / files.FOREIGN_DIST_METADATA).is_file() and not (folder / files.MANIFEST).exists()


def _common_state(folder: Path) -> dict:
    try:
        common = dist_checkpointing.load_common_state_dict(str(folder))
    except Exception as err:  # noqa: BLE001 - megatron-core and torch raise many kinds here
        raise CheckpointError(f"{folder}: cannot read the Megatron-LM checkpoint's common state "
                              f"({type(err).__name__}: {err})") from None
    if not isinstance(common.get("args"), argparse.Namespace) or "iteration" not in common:
        raise CheckpointError(f"{folder}: not a Megatron-LM training checkpoint (no args or iteration in it)")
    return common


def model_signature(args: dict) -> dict:
    """The model flags of :data:`~megatron_dilocox.checkpoint.checkpointing.MODEL_FLAGS` from
    Megatron-LM's args (it names two of them differently)."""
    groups = args["num_query_groups"] if args.get("group_query_attention") else args["num_attention_heads"]
    return {"num_layers": args["num_layers"], "hidden_size": args["hidden_size"],
            "ffn_hidden_size": args["ffn_hidden_size"], "num_attention_heads": args["num_attention_heads"],
            "num_query_groups": groups, "position_embedding_type": args["position_embedding_type"],
            "rotary_base": args.get("rotary_base", 10000), "max_position_embeddings": args["max_position_embeddings"],
            "normalization": args["normalization"], "swiglu": args["swiglu"],
            "untie_embeddings_and_output_weights": args["untie_embeddings_and_output_weights"],
            "disable_bias_linear": not args["add_bias_linear"], "padded_vocab_size": args["padded_vocab_size"]}


def _in_iterations(scheduler: dict, global_batch_size: int) -> dict:
    return {key: value // global_batch_size if key in _SAMPLE_COUNTS else value for key, value in scheduler.items()}


def read_manifest(folder) -> dict:
    """A manifest like ours for a Megatron-LM iteration folder: its iteration, model flags,
    batch, schedule and args (the model flags under our names; ``layout`` None: it loads
    weights only)."""
    folder = Path(folder)
    common = _common_state(folder)
    # Its enums (attention_backend ...) by name, as flags give them.
    args = {name: value.name if isinstance(value, enum.Enum) else value for name, value in vars(common["args"]).items()}
    for flag, off in UNBUILT_FEATURES.items():
        if args.get(flag, off) != off:
            raise CheckpointError(f"{folder}: trained with --{flag.replace('_', '-')} {args[flag]}, "
                                  "a model this package does not build")
    batch = int(args["global_batch_size"])
    signature = model_signature(args)
    manifest = {"kind": "megatron-lm", "iteration": int(common["iteration"]), "eval_round": 0,
                "global_batch_size": batch, "model": signature, "layout": None, "dilocox": None,
                "args": {**args, **signature}, "files": {}}
    if "opt_param_scheduler" in common:
        manifest["scheduler"] = _in_iterations(common["opt_param_scheduler"], batch)
    return manifest


def tracked_folder(root) -> Path | None:
    """The iteration folder the tracker of a Megatron-LM save directory points at (None when
    ``root`` is not one)."""
    root = Path(root)
    tracker = root / files.TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    folder = root / RELEASE if text == RELEASE else files.iteration_dir(root, int(text)) if text.isdigit() else None
    return folder if folder is not None and is_checkpoint(folder) else None


def megatron_args(run_args: dict, iteration: int) -> argparse.Namespace:
    """The ``args`` a Megatron-LM checkpoint carries, from a run's flags (named as Megatron-LM
    names them) plus the entries its loader reads that this package does not have: a converted
    checkpoint holds weights only (no optimizer, no RNG) and loads into any layout."""
    signature = {"add_bias_linear": not run_args.get("disable_bias_linear", False),
                 "group_query_attention": run_args.get("num_query_groups") is not None}
    loader = {"ckpt_format": "torch_dist", "no_save_optim": True, "no_save_rng": True, "world_size": 1,
              "data_parallel_size": 1, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
              "iteration": iteration, "consumed_train_samples": iteration * int(run_args.get("global_batch_size") or 0)}
    return argparse.Namespace(**{**run_args, **signature, **loader})


def save(root, iteration: int, sharded_state_dict: dict, args: argparse.Namespace) -> Path:
    """Writes ``iter_NNNNNNN/`` and moves the tracker to it, as Megatron-LM's ``save_checkpoint``
    lays them out (one process; the folder appears whole or not at all)."""
    final = files.iteration_dir(root, iteration)
    partial = files.start(root, iteration)
    dist_checkpointing.save({"model": sharded_state_dict, "args": args, "iteration": iteration,
                             "checkpoint_version": CHECKPOINT_VERSION, "num_floating_point_operations_so_far": 0},
                            str(partial))
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    files.write_atomic(Path(root) / files.TRACKER, f"{iteration}\n".encode())
    return final
