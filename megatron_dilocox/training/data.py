"""Train/validation data through megatron-core's GPTDataset, sliced per rank.

Every rank reads its own samples straight from the memory-mapped dataset (no broadcast
inside a TP group: the read is deterministic). Sample ``i`` of global step ``s`` is
``s * global_batch + i``; a global batch is cut into micro-batches, and each micro-batch
into one slice per data-parallel replica. With DiLoCoX the replicas of all clusters share
this numbering (cluster-major), so every cluster reads a disjoint part of each global batch
and a DiLoCoX run consumes exactly the tokens of an AllReduce run with the same flags.
"""

import os

import numpy
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import _IndexReader

from megatron_dilocox.arguments import ConfigError


def _blend(data_path):
    if len(data_path) == 1:
        return [data_path[0]], None
    return list(data_path[1::2]), [float(w) for w in data_path[0::2]]


def _check_files(prefixes, vocab_size: int):
    """Each prefix has a readable .idx, a .bin of exactly the size the .idx describes, and token
    ids the tokenizer knows (checked on the first million tokens)."""
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            path = prefix + ext
            if not os.path.isfile(path):
                raise ConfigError(f"--data-path: file not found: {path}")
        try:
            index = _IndexReader(prefix + ".idx", multimodal=False)
        except Exception as err:  # megatron raises AssertionError, struct.error, ValueError, ...
            raise ConfigError(f"--data-path: not a megatron index file: {prefix}.idx ({err or type(err).__name__})") from None
        expected = 0
        if index.sequence_count:
            expected = int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * index.dtype_size
        actual = os.path.getsize(prefix + ".bin")
        if actual != expected:
            raise ConfigError(f"--data-path: {prefix}.bin has {actual} bytes, its .idx expects {expected} "
                              "(truncated or mismatched files)")
        head = numpy.memmap(prefix + ".bin", dtype=index.dtype, mode="r")[:1_000_000]
        if head.size and int(head.max()) >= vocab_size:
            raise ConfigError(f"--data-path: {prefix}.bin holds token id {int(head.max())} but the tokenizer has "
                              f"{vocab_size} tokens: was it made with another --tokenizer-model?")


def build_datasets(args, tokenizer):
    """(train, valid) GPTDatasets sized for the whole run."""
    blend = None
    if not args.mock_data:
        blend = _blend(args.data_path)
        _check_files(blend[0], tokenizer.vocab_size)
    evals = (args.train_iters // args.eval_interval + 1) * args.eval_iters
    # None: one epoch of the validation split, for --full-validation.
    valid_size = None if args.full_validation else evals * args.global_batch_size
    sizes = [args.train_iters * args.global_batch_size, valid_size, 0]
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        split=args.split,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=args.data_cache_path,
        mid_level_dataset_surplus=0.005,
        full_validation=args.full_validation,
    )
    cls = MockGPTDataset if args.mock_data else GPTDataset
    try:
        train, valid, _ = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()
    except (AssertionError, ValueError, OSError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"--data-path {' '.join(args.data_path or [])}: unreadable dataset: {first_line}") from err
    if train is None or valid is None:
        raise ConfigError(f"--split {args.split}: the train and validation splits must both be non-empty")
    if args.full_validation and len(valid) < args.global_batch_size:
        raise ConfigError(f"--full-validation: the validation split has {len(valid)} samples, fewer than one "
                          f"--global-batch-size {args.global_batch_size}; give it more with --split")
    return train, valid


class MicroBatches:
    """Micro-batches of one replica: ``tokens``, ``labels``, ``loss_mask``, ``position_ids``."""

    def __init__(self, dataset, global_batch_size: int, micro_batch_size: int,
                 dp_size: int, dp_rank: int):
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.num_microbatches = global_batch_size // (micro_batch_size * dp_size)

    def step(self, step: int):
        """Iterator over this replica's micro-batches of global step ``step``."""
        first = step * self.global_batch_size
        stride = self.micro_batch_size * self.dp_size
        for m in range(self.num_microbatches):
            start = first + m * stride + self.dp_rank * self.micro_batch_size
            samples = [self.dataset[(start + i) % len(self.dataset)] for i in range(self.micro_batch_size)]
            yield {key: torch.stack([s[key] for s in samples])
                   for key in ("tokens", "labels", "loss_mask", "position_ids")}
