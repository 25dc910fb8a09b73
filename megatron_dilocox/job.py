"""From parsed flags to a running job: process groups, data, model, optimizers, loop.

The entry point's layer, above ``training/`` and ``checkpoint/``, which never import each other:
it wires the two, handing a resumed checkpoint's state to :meth:`Trainer.load_state_dict` and
:func:`checkpointing.save` to the trainer.

Without CUDA, megatron-core runs here only through the CPU bridge, which the entry point
installs first (:func:`megatron_dilocox.platform.cpu.prepare`); importing this module does not.
"""

import dataclasses
import os
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_dilocox.arguments import padded_vocab_size, validate_world
from megatron_dilocox.checkpoint import checkpointing
from megatron_dilocox.checkpoint.checkpointing import Resume, lock_save_dir
from megatron_dilocox.comm_audit import CommAudit
from megatron_dilocox.data.tokenizer import build_tokenizer
from megatron_dilocox.errors import ClusterLossError, ConfigError, StateDivergedError
from megatron_dilocox.platform import backend, cpu
from megatron_dilocox.run_config import CheckpointConfig, LoggingConfig, RunConfig
from megatron_dilocox.topology import build_topology, init_distributed
from megatron_dilocox.training.data import build_datasets
from megatron_dilocox.training.dilocox import DiLoCoX
from megatron_dilocox.training.loop import Trainer
from megatron_dilocox.training.metrics import MetricsLogger
from megatron_dilocox.training.model import build_gpt_chunks, initialize_parameters, transformer_config, wrap_ddp


def build_optimizer(run: RunConfig, model, config, topo):
    """megatron-core AdamW (the inner optimizer) and its learning-rate schedule, from the training
    section (and whether the parallelism section shards the optimizer state)."""
    training = run.training
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam",
        lr=training.lr,
        min_lr=training.min_lr,
        weight_decay=training.weight_decay,
        adam_beta1=training.adam_beta1,
        adam_beta2=training.adam_beta2,
        adam_eps=training.adam_eps,
        clip_grad=training.clip_grad,
        bf16=training.bf16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=run.parallel.use_distributed_optimizer,
    ), model, use_gloo_process_groups=False, pg_collection=topo.pg_collection)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if training.lr_warmup_steps else training.lr,
        max_lr=training.lr,
        min_lr=training.min_lr,
        lr_warmup_steps=training.lr_warmup_steps,
        lr_decay_steps=training.lr_decay_iters,
        lr_decay_style=training.lr_decay_style,
        start_wd=training.weight_decay,
        end_wd=training.weight_decay,
        wd_incr_steps=training.train_iters,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def connect_clusters(exchange, clusters: int, topo, audit):
    """The outer link of this cluster job: its torchft Manager (one per rank, on the job's own
    torchrun store) and the agreement over the cluster's ranks."""
    from megatron_dilocox.outer.cluster_exchange import ExchangeLink

    return ExchangeLink(exchange, clusters, rank=dist.get_rank(), world_size=dist.get_world_size(),
                        store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
                        settle_group=topo.exchange_group, audit=audit)


def per_cluster(path: str | None, cluster: int, file: bool = False) -> str | None:
    """Where cluster ``cluster`` of a job per cluster keeps what would be ``path`` in one world:
    its own checkpoint folder ``PATH/cluster-K``; a file: cluster 0's is ``path``, the others'
    ``STEM.cluster-K.SUFFIX`` beside it."""
    if path is None:
        return None
    if not file:
        return os.path.join(path, f"cluster-{cluster}")
    if cluster == 0:
        return path
    stem, suffix = os.path.splitext(path)
    return f"{stem}.cluster-{cluster}{suffix}"


def _per_cluster_job(checkpoint: CheckpointConfig, logging: LoggingConfig, cluster: int):
    """The folders and files of cluster ``cluster`` of a job per cluster (:func:`per_cluster`)."""
    load = checkpoint.load
    if load and os.path.isdir(per_cluster(load, cluster)):
        load = per_cluster(load, cluster)
    return (dataclasses.replace(checkpoint, save=per_cluster(checkpoint.save, cluster), load=load),
            dataclasses.replace(logging, metrics_file=per_cluster(logging.metrics_file, cluster, file=True)))


def setup(run: RunConfig):
    """Builds everything a :class:`Trainer` needs."""
    if not backend.on_cuda() and not cpu.installed():
        raise RuntimeError("megatron-core needs the CPU bridge here: call megatron_dilocox.platform.cpu.prepare() "
                           "before importing megatron-core")
    backend.use_local_device()
    parallel = run.parallel
    init_distributed(backend.process_group_backend(parallel.distributed_backend), parallel.distributed_timeout_minutes)
    validate_world(run, dist.get_world_size())
    outer, exchange = run.outer, run.exchange
    if outer.offload_outer_state and not backend.on_cuda():  # on the CPU the state is in host memory already
        outer = dataclasses.replace(outer, offload_outer_state=False)
    cluster_job = exchange.cluster_index if exchange.lighthouse else None
    topo = build_topology(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                          run.virtual_pipeline_model_parallel_size, outer.clusters, run.dilocox,
                          outer.outer_timeout_s, outer_backend="gloo" if outer.offload_outer_state else None,
                          cluster_job=cluster_job)
    if cluster_job is not None:
        run.checkpoint, run.logging = _per_cluster_job(run.checkpoint, run.logging, cluster_job)
    if run.checkpoint.save:
        lock_save_dir(run.checkpoint.save)  # before anything is read or written: one run per save directory
    audit = CommAudit(topo.cluster_size).install() if topo.clusters > 1 else None
    seed = run.training.seed
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    data = run.data
    try:
        tokenizer = build_tokenizer(data.tokenizer_type, data.tokenizer_model, data.vocab_size)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    train_data, valid_data = build_datasets(run, tokenizer)
    config = transformer_config(run)
    run.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, run.model, parallel.tensor_model_parallel_size)
    chunks = build_gpt_chunks(run.model, config, run.padded_vocab_size)
    initialize_parameters(chunks, config, seed, tied=not run.model.untie_embeddings_and_output_weights)
    model = wrap_ddp(chunks, config, topo, parallel.use_distributed_optimizer)
    resume = Resume.find(run, topo) if run.checkpoint.load else None
    if resume is not None:
        resume.load_weights(model)  # before the optimizer copies them into its main params
    optimizer, scheduler = build_optimizer(run, model, config, topo)
    dilocox = None
    if run.dilocox:
        link = connect_clusters(exchange, outer.clusters, topo, audit) if cluster_job is not None else None
        dilocox = DiLoCoX(optimizer, topo, outer, run.compression, seed, audit, link)
    is_writer = dist.get_rank() == dist.get_world_size() - 1
    logger = MetricsLogger(run.logging, run.training.train_iters, run.training.global_batch_size, is_writer,
                           settings=run.flat())
    save_checkpoint = partial(checkpointing.save, run, topo) if run.checkpoint.save else None
    trainer = Trainer(run, topo, model, optimizer, scheduler, train_data, valid_data, logger, dilocox, audit,
                      save_checkpoint)
    if resume is not None:
        logger.print(resume.describe())
        resume.restore(trainer.load_state_dict)
    return trainer


def describe(run: RunConfig, topo) -> str:
    parallel, vpp = run.parallel, run.virtual_pipeline_model_parallel_size
    layout = (f"TP={parallel.tensor_model_parallel_size} PP={parallel.pipeline_model_parallel_size}"
              f"{' VPP=' + str(vpp) if vpp else ''}"
              f" DP={topo.data_parallel_size}")
    if run.dilocox:
        return (f"DiLoCoX: {topo.clusters} clusters x {topo.cluster_size} ranks ({layout}, DP_in={topo.inner_dp_size}), "
                f"H={run.outer.local_steps}, sync mode {run.outer.sync_mode}")
    return f"vanilla AllReduce: {layout}"


def run(run_config: RunConfig) -> None:
    trainer = setup(run_config)
    training = run_config.training
    if cpu.installed():
        trainer.logger.print(cpu.NOTE)
    trainer.logger.print(f"> {describe(run_config, trainer.topo)}; {training.train_iters} iterations, "
                         f"global batch {training.global_batch_size} x {run_config.model.seq_length} tokens")
    try:
        trainer.train()
    except (ClusterLossError, StateDivergedError):
        if trainer.dilocox is not None:
            # Leave the outer exchange before the error ends the process: torchft's threads
            # still running at interpreter exit abort it ("terminate called without an active exception").
            trainer.dilocox.stop()
        raise
    if backend.on_cuda():
        trainer.logger.memory(training.train_iters, torch.cuda.max_memory_allocated(),
                              torch.cuda.host_memory_stats().get("allocated_bytes.peak"))
    if run_config.logging.metrics_file:
        trainer.logger.print(f"> metrics written to {os.path.abspath(run_config.logging.metrics_file)}")
    trainer.logger.close()
    dist.destroy_process_group()
