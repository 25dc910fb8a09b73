"""Single-process reference of DiLoCoX on real megatron models: C model copies (TP1/PP1),
each trained on its cluster's data shard, combined by the plain outer-loop reference.

    torchrun --nproc-per-node 1 tests/reference_dilocox.py OUT_DIR SPEC_JSON

SPEC_JSON: list of {"name", "flags"} as for tests/scenarios.py, with --dilocox flags; writes
OUT_DIR/NAME.reference.pt with the final global parameters keyed by global name (and
OUT_DIR/NAME.init.pt with the initial ones).
"""

import dataclasses
import json
import sys

import torch
import torch.distributed as dist

from megatron_dilocox.arguments import padded_vocab_size, parse_args, validate_world
from megatron_dilocox.data.tokenizer import build_tokenizer
from megatron_dilocox.megatron_state import main_params
from megatron_dilocox.outer.compression import CompressedReducer
from megatron_dilocox.outer.reference import ReferenceDiLoCo, quantized_arrival
from megatron_dilocox.platform import cpu
from megatron_dilocox.topology import build_topology, init_distributed
from megatron_dilocox.training.data import MicroBatches, build_datasets
from megatron_dilocox.training.loop import Trainer
from megatron_dilocox.training.metrics import MetricsLogger
from megatron_dilocox.training.model import (
    build_gpt_chunks, gather_full_params, initialize_parameters, transformer_config, wrap_ddp)
from megatron_dilocox.job import build_optimizer
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed


def replica(args, topo, tokenizer, train, valid, shard, clusters):
    config = transformer_config(args)
    chunks = build_gpt_chunks(args.model, config, padded_vocab_size(tokenizer.vocab_size, args.model))
    initialize_parameters(chunks, config, args.training.seed, tied=not args.model.untie_embeddings_and_output_weights)
    model = wrap_ddp(chunks, config, topo, use_distributed_optimizer=False)
    optimizer, scheduler = build_optimizer(args, model, config, topo)
    trainer = Trainer(args, topo, model, optimizer, scheduler, train, valid,
                      MetricsLogger(args.logging, args.training.train_iters, args.training.global_batch_size, False))
    trainer.train_batches = MicroBatches(train, args.training.global_batch_size, args.training.micro_batch_size,
                                         clusters, shard)
    return trainer


def run(spec, out):
    args = parse_args(spec["flags"])
    clusters, cfg, comp = args.clusters, args.outer, args.compression
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        setattr(args.parallel, name, 1)
    args.virtual_pipeline_model_parallel_size = None
    args.dilocox, args.outer = False, dataclasses.replace(cfg, clusters=1)
    validate_world(args, 1)
    topo = build_topology(1, 1, None, 1)
    torch.manual_seed(args.training.seed)
    model_parallel_cuda_manual_seed(args.training.seed)
    tokenizer = build_tokenizer(args.data.tokenizer_type, args.data.tokenizer_model, args.data.vocab_size)
    train, valid = build_datasets(args, tokenizer)
    replicas = [replica(args, topo, tokenizer, train, valid, k, clusters) for k in range(clusters)]
    tied = not args.model.untie_embeddings_and_output_weights
    torch.save(gather_full_params(replicas[0].model, tied), f"{out}/{spec['name']}.init.pt")
    params = [main_params(r.optimizer) for r in replicas]
    compressors = None  # one per replica, as each cluster's rank holds one (TP1/PP1 runs only)
    if comp.codec != "none":
        compressors = [CompressedReducer([p.shape for p in params[0]], comp, seed=args.training.seed) for _ in range(clusters)]
    flush = None
    if comp.flush_residual:
        sent = comp.flush_config()
        flush = quantized_arrival([p.numel() for p in params[0]], sent.bits, sent.block)
    ref = ReferenceDiLoCo(params[0], clusters, cfg.sync_mode, cfg.peak_outer_lr, cfg.outer_momentum, cfg.use_nesterov,
                          compressors, comp.keep_unsent, flush, cfg.outer_lr_at, cfg.averages_at_end)
    boundary, landing = cfg.local_steps_at(0), None
    for iteration in range(1, args.training.train_iters + 1):
        for r in replicas:
            r.train_step(iteration - 1)
        if iteration in (boundary, args.training.train_iters):  # the last iteration ends a round too
            ref.step(params, iteration, replicas[0].lr_scale())
            h = cfg.local_steps_at(iteration)
            boundary += h
            landing = iteration + cfg.landing if cfg.landing and cfg.landing < h else None
        elif iteration == landing:
            ref.land(params)
    ref.finish(params)
    torch.save(gather_full_params(replicas[0].model, tied), f"{out}/{spec['name']}.reference.pt")
    parallel_state.destroy_model_parallel()


def main():
    out, spec_path = sys.argv[1], sys.argv[2]
    cpu.prepare()
    init_distributed("gloo", 10)
    with open(spec_path) as f:
        for spec in json.load(f):
            run(spec, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
