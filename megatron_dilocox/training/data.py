"""Train/validation data through megatron-core's GPTDataset, sliced per rank.

Every rank reads its own samples straight from the memory-mapped dataset (no broadcast
inside a TP group: the read is deterministic). Sample ``i`` of global step ``s`` is
``s * global_batch + i``; a global batch is cut into micro-batches, and each micro-batch
into one slice per data-parallel replica. With DiLoCoX the replicas of all clusters share
this numbering (cluster-major), so every cluster reads a disjoint part of each global batch
and a DiLoCoX run consumes exactly the tokens of an AllReduce run with the same flags.
"""

import json
import os
import sys

import numpy
import torch
import torch.distributed as dist
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import _IndexReader

from megatron_dilocox.data.tokenizer import IDENTITY_SUFFIX
from megatron_dilocox.errors import ConfigError
from megatron_dilocox.run_config import RunConfig


def _blend(data_path):
    if len(data_path) == 1:
        return [data_path[0]], None
    return list(data_path[1::2]), [float(w) for w in data_path[0::2]]


def _described(identity: dict) -> str:
    sha = identity.get("model_sha256")
    return (f"{identity.get('model') or identity.get('tokenizer_type')} "
            f"({'sha256 ' + sha[:12] + '..., ' if sha else ''}{identity.get('vocab_size')} tokens)")


def _check_tokenizer(prefix: str, tokenizer) -> bool:
    """Refuses a tokenizer other than the one recorded with the dataset; False if none is recorded."""
    path = prefix + IDENTITY_SUFFIX
    if not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            recorded = json.load(f)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--data-path: unreadable tokenizer record {path} ({err})") from None
    mine = tokenizer.identity
    if any(recorded.get(key) != mine[key] for key in ("tokenizer_type", "model_sha256", "vocab_size")):
        raise ConfigError(f"--data-path: {prefix}.bin was made with another --tokenizer-model: {_described(recorded)} "
                          f"(recorded in {path}), this run has {_described(mine)}")
    return True


def _check_files(prefixes, tokenizer) -> list[str]:
    """Each prefix has a readable .idx, a .bin of exactly the size the .idx describes, was made
    with this tokenizer (where its record says) and holds token ids the tokenizer knows (checked
    on the first million tokens). Returns the prefixes without a tokenizer record."""
    vocab_size, unrecorded = tokenizer.vocab_size, []
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
        if not _check_tokenizer(prefix, tokenizer):
            unrecorded.append(prefix)
        head = numpy.memmap(prefix + ".bin", dtype=index.dtype, mode="r")[:1_000_000]
        if head.size and int(head.max()) >= vocab_size:
            raise ConfigError(f"--data-path: {prefix}.bin holds token id {int(head.max())} but the tokenizer has "
                              f"{vocab_size} tokens: was it made with another --tokenizer-model?")
    return unrecorded


def split_tokens(index, bounds) -> tuple[int, int]:
    """(documents, tokens) of one dataset's split, given megatron's ``bounds`` (fractions of its
    documents, rounded as megatron rounds them); ``index`` is the dataset's megatron index reader."""
    documents = len(index.document_indices) - 1
    begin, end = (int(round(b * documents)) for b in bounds)
    first, last = int(index.document_indices[begin]), int(index.document_indices[end])
    return end - begin, int(numpy.asarray(index.sequence_lengths[first:last], dtype=numpy.int64).sum())


def _check_splits(prefixes, split_matrix, split: str, seq_length: int):
    """Every split that samples are drawn from gets at least one sample's tokens of every dataset:
    megatron never finishes indexing an empty split, and a smaller one repeats within a sample."""
    need = seq_length + 1
    for prefix in prefixes:
        index = _IndexReader(prefix + ".idx", multimodal=False)
        for name, bounds in zip(("train", "validation", "test"), split_matrix):
            if bounds is None:
                continue
            documents, tokens = split_tokens(index, bounds)
            if tokens < need:
                raise ConfigError(f"--split {split}: the {name} split of {prefix} gets {documents} of its "
                                  f"{len(index.document_indices) - 1} documents ({tokens} tokens), fewer than one "
                                  f"sample (--seq-length + 1 = {need} tokens): give it a larger share")


def build_datasets(run: RunConfig, tokenizer):
    """(train, valid) GPTDatasets sized for the whole run: the data section's datasets, as many
    samples as training and evaluation draw."""
    data, training, logging = run.data, run.training, run.logging
    batch = training.global_batch_size
    blend = None
    if not data.mock_data:
        blend = _blend(data.data_path)
        unrecorded = _check_files(blend[0], tokenizer)
        if unrecorded and dist.get_rank() == 0:
            print(f"WARNING: --data-path: no {IDENTITY_SUFFIX} tokenizer record for {', '.join(unrecorded)} "
                  "(made by an older tools/preprocess_data.py?): the tokenizer is only checked against the "
                  "token ids", file=sys.stderr, flush=True)
    evals = (training.train_iters // logging.eval_interval + 1) * logging.eval_iters
    # None: one epoch of the validation split, for --full-validation.
    valid_size = None if logging.full_validation else evals * batch
    sizes = [training.train_iters * batch, valid_size, 0]
    config = GPTDatasetConfig(
        random_seed=training.seed,
        sequence_length=run.model.seq_length,
        blend=blend,
        split=data.split,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=data.data_cache_path,
        mid_level_dataset_surplus=0.005,
        full_validation=logging.full_validation,
    )
    # Leave out the splits no sample is drawn from (the test split; validation without --eval-iters):
    # megatron would index them anyway, forever if one is empty.
    config.split_matrix = [None if size == 0 else bounds for bounds, size in zip(config.split_matrix, sizes)]
    if blend is not None:
        _check_splits(blend[0], config.split_matrix, data.split, run.model.seq_length)
    cls = MockGPTDataset if data.mock_data else GPTDataset
    try:
        train, valid, _ = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()
    except (AssertionError, ValueError, OSError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"--data-path {' '.join(data.data_path or [])}: unreadable dataset: {first_line}") from err
    if train is None or (valid is None and valid_size != 0):
        raise ConfigError(f"--split {data.split}: the train and validation splits must both be non-empty")
    if logging.full_validation and len(valid) < batch:
        raise ConfigError(f"--full-validation: the validation split has {len(valid)} samples, fewer than one "
                          f"--global-batch-size {batch}; give it more with --split")
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
