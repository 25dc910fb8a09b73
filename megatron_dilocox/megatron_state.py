"""What the project reads and writes of megatron-core's optimizer and model objects.

The inner optimizer's fp32 main params: megatron-core keeps the params its optimizer updates
(fp32 copies for bf16 models; for the distributed optimizer, this rank's shard of them) in the
optimizer's ``param_groups``. The outer loop and exact-resume checkpoints work on them; after
writing them, :func:`push_to_model` refreshes the model weights exactly as megatron does after
an optimizer step.

The model's weights as megatron's sharded state dict (:func:`model_sharded_state_dict`), whose
keys do not depend on the parallel layout: what checkpoints save and load.

This module sits below ``training/`` and ``checkpoint/``, which both use it and never import
each other (:mod:`megatron_dilocox.job` wires them).
"""

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.transformer.module import Float16Module


def leaf_optimizers(optimizer) -> list:
    return getattr(optimizer, "chained_optimizers", [optimizer])


def main_params(optimizer) -> list[torch.Tensor]:
    """The fp32 params the inner optimizer updates, in a fixed order."""
    return [p for opt in leaf_optimizers(optimizer) for group in opt.optimizer.param_groups for p in group["params"]]


def model_param_of(optimizer) -> dict[int, torch.Tensor]:
    """``id(main param) -> model param`` (the same tensor for fp32 models; not for the
    distributed optimizer, whose main params are shards)."""
    pairs = {}
    for opt in leaf_optimizers(optimizer):
        for model_group, main_group in zip(getattr(opt, "float16_groups", []),
                                           getattr(opt, "fp32_from_float16_groups", [])):
            pairs.update({id(main): model for model, main in zip(model_group, main_group)})
    return {id(p): pairs.get(id(p), p) for p in main_params(optimizer)}


def uses_distributed_optimizer(optimizer) -> bool:
    return any(getattr(opt, "ddp_config", None) is not None and opt.ddp_config.use_distributed_optimizer
               for opt in leaf_optimizers(optimizer))


def push_to_model(optimizer) -> None:
    """Copies main params into the model weights (and all-gathers distributed shards)."""
    for opt in leaf_optimizers(optimizer):
        if hasattr(opt, "_copy_main_params_to_model_params"):
            opt._copy_main_params_to_model_params()
        if getattr(opt, "ddp_config", None) is not None and opt.ddp_config.use_distributed_optimizer:
            for chunk in opt.model_chunks:
                chunk.start_param_sync(force_sync=True)


def unwrap(chunk):
    """The GPTModel inside megatron's DDP and Float16Module wrappers."""
    while isinstance(chunk, (DistributedDataParallel, Float16Module)):
        chunk = chunk.module
    return chunk


def model_sharded_state_dict(model) -> dict:
    """megatron's sharded state dict of every model chunk (keys are layout-independent)."""
    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}
