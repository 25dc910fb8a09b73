"""Where the model runs: its parallel layout and the machine, in the units of the plan (bandwidth
in Gbit/s, 1 Gbps = 1e9 / 8 bytes/s; memory in GiB, 2**30 bytes)."""
from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


def gbps_to_bytes_per_s(gbps: float) -> float:
    return gbps * 1e9 / 8


@dataclass
class Layout:
    """How one cluster splits the model and the batch (pretrain_gpt.py's flags)."""

    tp: int = 1
    pp: int = 1
    micro_batch_size: int = 1
    global_batch_size: int = 1
    """Samples per step over all clusters (Megatron's meaning: all data-parallel ranks)."""
    use_distributed_optimizer: bool = False
    bf16: bool = False
    recompute_full: bool = False


@dataclass
class Machine:
    """The hardware of a cluster and the link between clusters."""

    gpu_memory_gib: float = 80.0
    gpu_tflops: float = 400.0
    """Achievable dense bf16 TFLOP/s per GPU (not the datasheet peak)."""
    gpus_per_cluster: int = 8
    intra_bandwidth_gbps: float = 400.0
    """Per-GPU bandwidth of the data-parallel all-reduce and pipeline sends inside a cluster."""
    tp_bandwidth_gbps: float = 3600.0
    """Per-GPU bandwidth of the tensor-parallel all-reduces (NVLink inside a node)."""
    inter_bandwidth_gbps: float = 1.0
    inter_link: str = "shared"
    """``shared``: one link between clusters for all ranks; ``per-rank``: one per rank."""
    cpu_cores: int = 0
    """CPU mode when > 0: every rank of every cluster is a process on one machine with this many
    cores (how the calibration runs on CPU work); 0: one GPU per rank."""
    cpu_gflops_1thread: float = 0.0
    """CPU mode: achieved matmul GFLOP/s of one single-threaded process (measured)."""
    cpu_gflops_all_threads: float = 0.0
    """CPU mode: achieved matmul GFLOP/s of one process using all cores' threads (measured)."""
    cpu_elementwise_ns: float = 0.0
    """CPU mode: nanoseconds of everything that is not a matmul (norms, softmax, element-wise
    ops, optimizer, Python) per token, hidden unit and layer of a training step at one thread.
    Every tensor-parallel rank does all of it (norms and residuals are replicated; what TP does
    split is a small share), so unlike the matmuls it does not shrink with TP; threads speed it
    up as they speed up the matmuls. Fitted to one measured run by tools/calibrate_planner.py."""
