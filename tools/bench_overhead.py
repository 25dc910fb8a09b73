"""Per-iteration overhead of the framework's training step over a bare megatron-core loop.

    torchrun --nproc-per-node 4 tools/bench_overhead.py [pretrain_gpt.py flags]

Builds one model with the framework, then alternates timed blocks of
  (a) the framework's step (``Trainer.train_step``: data from the GPTDataset, schedule,
      optimizer, LR schedule, and under --dilocox-clusters the traffic audit), and
  (b) a bare loop written straight against megatron-core: zero the grad buffers, run the same
      forward-backward schedule on micro-batches already in memory, optimizer step,
on the same model, optimizer and schedule. Blocks come in adjacent pairs (in alternating
order) so that machine noise hits both alike; prints the median ms/iteration of each and the
median over pairs of the overhead of (a) over (b).
"""

import statistics
import sys
import time

import torch.distributed as dist

from megatron_dilocox.platform import cpu

cpu.prepare()  # before megatron-core is imported
from megatron_dilocox.arguments import parse_args  # noqa: E402
from megatron_dilocox.job import setup  # noqa: E402
from megatron_dilocox.training.loop import forward_step  # noqa: E402


def bare_step(trainer, batches):
    """One iteration with nothing but megatron-core calls."""
    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    iterators = [iter(batches) for _ in trainer.model]
    trainer.schedule(
        forward_step_func=forward_step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=trainer.model if len(trainer.model) > 1 else trainer.model[0],
        num_microbatches=len(batches),
        seq_length=trainer.seq_length,
        micro_batch_size=trainer.train_batches.micro_batch_size,
        forward_only=False,
    )
    trainer.optimizer.step()


def timed_block(step_fn, iterations):
    dist.barrier()
    start = time.perf_counter()
    for i in range(iterations):
        step_fn(i)
    dist.barrier()
    return (time.perf_counter() - start) / iterations * 1000.0


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    blocks, per_block = 16, 5
    args = parse_args(argv + ["--train-iters", str(2 * blocks * per_block + 10)] if "--train-iters" not in argv else argv)
    trainer = setup(args)
    batches = list(trainer.train_batches.step(0))
    for i in range(3):  # warm-up
        trainer.train_step(i)
        bare_step(trainer, batches)
    framework, bare = [], []
    step = 3

    def run_framework():
        nonlocal step
        framework.append(timed_block(lambda i: trainer.train_step(step + i), per_block))
        step += per_block

    def run_bare():
        bare.append(timed_block(lambda i: bare_step(trainer, batches), per_block))

    for block in range(blocks):
        for run in ((run_framework, run_bare) if block % 2 == 0 else (run_bare, run_framework)):
            run()
    overheads = [f / b - 1 for f, b in zip(framework, bare)]
    trainer.logger.print(
        f"framework step: {statistics.median(framework):.1f} ms/iter, "
        f"bare megatron-core step: {statistics.median(bare):.1f} ms/iter "
        f"({blocks} pairs of {per_block}-iteration blocks)\n"
        f"overhead, median over pairs: {100.0 * statistics.median(overheads):+.1f}% "
        f"(quartiles {100.0 * statistics.quantiles(overheads, n=4)[0]:+.1f}% .. "
        f"{100.0 * statistics.quantiles(overheads, n=4)[2]:+.1f}%)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
