"""Step time: one inner step of one cluster, the same for DiLoCoX and AllReduce.

One cluster processes global_batch / C samples per step: matmul FLOPs of the largest stage per
micro-batch (:func:`stage_flops_per_token`: 2 per weight and token forward, attention scores,
logits, backward = 2 forwards, full recompute + 1 forward of the layers) at ``--gpu-tflops``, plus
tensor-parallel all-reduces and pipeline sends, through the 1F1B schedule (bubble ``(PP - 1) / m``
for equal stages), then the data-parallel all-reduce of fp32 gradients, not overlapped::

    intra   = 2 (DP_in - 1) / DP_in * 4 N_rank / intra_bw

**CPU mode** (``Machine.cpu_cores`` > 0) predicts the CPU runs that calibrate this model: all
ranks are processes on one machine, the rate is a measured matmul GFLOP/s, and the processes of all
clusters share the cores.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_dilocox.planner.layout import Layout, Machine, gbps_to_bytes_per_s
from megatron_dilocox.planner.shapes import ModelShape, layer_tensors, padded_vocab


@dataclass(frozen=True)
class StepTime:
    """Seconds of one inner step of one cluster, by part (:func:`step_time` says how each adds up)."""

    matmul: float
    elementwise: float
    tp_comm: float
    p2p: float
    pipeline: float
    """The 1F1B schedule of every micro-batch's matmuls, element-wise work and communication."""
    cores_bound: float
    """CPU mode: all processes' compute over the shared cores (0 on GPUs)."""
    compute: float
    bubble_factor: float
    """Not seconds: the share the 1F1B bubble adds to the slowest stage's work."""
    intra_allreduce: float
    total: float
    tokens_per_step: int
    """Not seconds: the tokens of one step over all clusters."""


def layer_matmul_flops(m: ModelShape, tp: int = 1) -> float:
    """Forward matmul FLOPs per token of one layer on one TP rank: 2 per weight of its linear
    layers, plus the attention scores and the weighted values, 2 x 2 s h / tp (the local spec's
    unfused softmax computes the full s x s scores, causal or not)."""
    weights = sum(t.numel for t in layer_tensors(m, tp) if len(t.shape) == 2)
    return 2 * weights + 4 * m.seq_length * m.hidden_size / tp


def stage_flops_per_token(m: ModelShape, tp: int, pp: int, stage: int, recompute_full: bool = False) -> float:
    """Training matmul FLOPs per token on one (TP rank, pipeline stage): forward x 3 (backward
    = 2 forwards), x 4 for the layers under full recompute; the last stage adds the output
    logits (forward 2 V_pad h / tp). Embedding lookups, norms and element-wise ops: none."""
    layers = m.num_layers // pp * layer_matmul_flops(m, tp) * (4 if recompute_full else 3)
    v = padded_vocab(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    logits = 3 * 2 * v * m.hidden_size / tp if stage == pp - 1 else 0
    return layers + logits


def step_time(m: ModelShape, lay: Layout, mach: Machine, clusters: int, dp_in: int, nmb: int,
              n_rank: int) -> StepTime:
    """One inner step of one cluster (the same for DiLoCoX and AllReduce), in seconds.

    Per micro-batch, stage ``k`` takes ``tau_k`` = matmul FLOPs / rate + its tensor-parallel
    all-reduces (4 per layer: 2 forward, 2 backward, of ``s b h`` activations, ring cost
    ``2 (t - 1) / t``; 6 with full recompute) + its pipeline send and receive (``s b h``
    activations forward, the same gradient backward; none on the last stage). 1F1B then takes
    ``(m - 1) max_k tau_k + sum_k tau_k``, which is ``m tau (1 + (PP - 1) / m)`` for equal
    stages. Then the data-parallel all-reduce of the fp32 gradients, not overlapped.

    CPU mode (``mach.cpu_cores``): the rate is ``cpu_gflops_all_threads`` for a single process and
    ``cpu_gflops_1thread`` otherwise (torchrun sets OMP_NUM_THREADS=1 for several processes per
    node); each stage adds ``cpu_elementwise_ns`` x tokens x hidden x its layers, replicated on
    every TP rank and sped up by threads as the matmuls are; all clusters' processes share the
    cores, so the compute also takes at least (compute seconds of every process) / cores.
    """
    tp, pp, b, s, h = lay.tp, lay.pp, lay.micro_batch_size, m.seq_length, m.hidden_size
    act_bytes = 2 if lay.bf16 else 4
    tokens = b * s
    processes = clusters * mach.gpus_per_cluster
    elementwise = 0.0
    if mach.cpu_cores:
        if mach.cpu_gflops_1thread <= 0 or mach.cpu_gflops_all_threads <= 0:
            raise ValueError("CPU mode needs --cpu-gflops ONE_THREAD ALL_THREADS (measure with "
                             "tools/calibrate_planner.py, which prints them)")
        if mach.cpu_elementwise_ns < 0:
            raise ValueError(f"--cpu-elementwise-ns must be >= 0, got {mach.cpu_elementwise_ns}")
        threads = mach.cpu_gflops_all_threads / mach.cpu_gflops_1thread if processes == 1 else 1.0
        rate = 1e9 * mach.cpu_gflops_1thread * threads
        layer_passes = 4 / 3 if lay.recompute_full else 1.0  # recompute repeats the forward
        elementwise = mach.cpu_elementwise_ns * 1e-9 * tokens * h * (m.num_layers // pp) * layer_passes / threads
    else:
        rate = 1e12 * mach.gpu_tflops
    intra_bw, tp_bw = gbps_to_bytes_per_s(mach.intra_bandwidth_gbps), gbps_to_bytes_per_s(mach.tp_bandwidth_gbps)
    matmul = [stage_flops_per_token(m, tp, pp, k, lay.recompute_full) * tokens / rate for k in range(pp)]
    work = [mm + elementwise for mm in matmul]
    tp_calls = (6 if lay.recompute_full else 4) * (m.num_layers // pp)
    tp_comm = tp_calls * 2 * (tp - 1) / tp * tokens * h * act_bytes / tp_bw
    p2p = 2 * tokens * h * act_bytes / intra_bw
    tau = [work[k] + tp_comm + (p2p if k < pp - 1 else 0.0) for k in range(pp)]
    pipeline = (nmb - 1) * max(tau) + sum(tau)
    shared = 0.0
    if mach.cpu_cores:
        shared = clusters * dp_in * tp * nmb * sum(work) / mach.cpu_cores
    compute = max(pipeline, shared)
    intra = 2 * (dp_in - 1) / dp_in * 4 * n_rank / intra_bw
    return StepTime(matmul=nmb * max(matmul), elementwise=nmb * elementwise, tp_comm=nmb * tp_comm,
                    p2p=nmb * p2p * (pp > 1), pipeline=pipeline, cores_bound=shared, compute=compute,
                    bubble_factor=pipeline / (nmb * max(tau)) - 1, intra_allreduce=intra, total=compute + intra,
                    tokens_per_step=lay.global_batch_size * s)
