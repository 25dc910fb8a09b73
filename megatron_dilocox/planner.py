"""Back-of-the-envelope planner: parameters, per-GPU memory, step time and DiLoCoX vs AllReduce.

Pure arithmetic (no torch), used by ``tools/plan.py``. Every estimate is a documented formula,
not a measurement; the only constants are the ones written below. Units: bytes, seconds,
bandwidth in Gbit/s (1 Gbps = 1e9 / 8 bytes/s), memory in GiB (2**30 bytes).

**Parameters** (megatron-core GPT, local layer spec, ``kv = kv_channels * query_groups`` with
``kv_channels = h / heads``; ``b(x)`` is ``x`` with biases, 0 with ``--disable-bias-linear``;
``ln`` = 2h for LayerNorm, h for RMSNorm)::

    embedding   V_pad * h   (+ max_pos * h for learned absolute positions)
    per layer   ln                          input layernorm
                h * (h + 2 kv) + b(h + 2 kv)   QKV
                h * h + b(h)                   attention output projection
                ln                          pre-MLP layernorm
                h * f * g + b(f * g)          fc1 (g = 2 with SwiGLU, else 1)
                f * h + b(h)                   fc2
    final       ln
    output      V_pad * h if untied (tied: no new parameter; with PP > 1 the last stage holds a
                copy of the embedding, counted in its memory, not here; it follows the first
                stage's copy, so it has no outer state and sends no pseudo-gradient)

``V_pad`` = vocab rounded up to a multiple of lcm(make_vocab_size_divisible_by, TP).

**Memory per GPU** (the largest pipeline stage; no allowance for the CUDA context, allocator
fragmentation, NCCL buffers or logits, so keep some headroom):

* weights: 2 bytes/param with ``--bf16``, else 4;
* grads: 4 bytes/param (fp32 main-grad buffer of megatron DDP);
* inner AdamW: 12 bytes/param with bf16 (fp32 main param + 2 moments), 8 without; divided by
  DP_in with ``--use-distributed-optimizer``;
* outer DiLoCoX state: ``OUTER_BYTES_PER_PARAM`` (20 bytes/param in delay mode, 16 in sync, +4
  with error feedback, +4 more in sync with keep-unsent; see there) of the rank's outer shard (the distributed optimizer's shard,
  i.e. / DP_in, when it is used); with ``--dilocox-offload-outer-state`` it moves from the GPU to
  pinned host memory (``Plan.host_memory``, per GPU: multiply by GPUs per node for a node);
* activations (Korthikanti et al. 2022, 16-bit, no sequence parallel), per layer and
  micro-batch: ``s b h (10 + 24 / t + 5 a s / (h t))`` bytes, which is ``s b h (34 + 5 a s / h)``
  at t = 1; times the layers of a stage and the micro-batches in flight on the first stage with
  1F1B, ``min(PP, m)``. With full recompute only the layer inputs ``2 s b h`` are kept per layer
  and micro-batch, plus one layer's full activations for the recompute itself. Without ``--bf16``
  activations are doubled.

**Step time** (identical inner step for both methods; one cluster processes global_batch / C
samples per step; see :func:`step_time`): matmul FLOPs of the largest stage per micro-batch
(:func:`stage_flops_per_token`: 2 per weight and token forward, attention scores, logits,
backward = 2 forwards, full recompute + 1 forward of the layers) at ``--gpu-tflops``, plus
tensor-parallel all-reduces and pipeline sends, through the 1F1B schedule (bubble ``(PP - 1) / m``
for equal stages), then the data-parallel all-reduce of fp32 gradients, not overlapped::

    intra   = 2 (DP_in - 1) / DP_in * 4 N_rank / intra_bw

**CPU mode** (``Machine.cpu_cores`` > 0) predicts the CPU runs that calibrate this model: all
ranks are processes on one machine, the rate is a measured matmul GFLOP/s, and the processes of all
clusters share the cores.

**Cross-cluster link.** ``--inter-bandwidth-gbps`` is the link between two clusters, shared by
all M = TP PP DP_in ranks of a cluster (``--inter-link per-rank`` gives every rank its own link
instead). Per-rank bytes below are what one rank sends; link time = (sum over the cluster's
ranks) / bandwidth.

* AllReduce baseline: gradients are reduced over all C DP_in replicas every step,
  hierarchically (reduce-scatter inside the cluster, all-reduce across clusters, all-gather inside),
  so each rank sends ``2 (C - 1) / C * 4 N_rank / DP_in`` bytes of fp32 gradient across clusters
  per step, i.e. the whole model's fp32 gradient crosses once each way. Not overlapped with
  compute (stated assumption; the cross leg is far slower than the backward pass anyway).
* DiLoCoX: once per round of H steps each rank exchanges its outer shard's payload, from the
  formulas of ``megatron_dilocox/payload.py`` (the reducer's: a 40-byte header per exchange,
  blocks of 256 values with one fp32 scale, low-rank (m + n) r factors where they save bytes, 1-D
  dense; ``topk``: chunked indices, codes and scales of the flat shard).
  ``none`` is an fp32 ring all-reduce (``2 (C - 1) / C * payload`` on the wire); the codecs
  all-gather (``(C - 1) * payload``). In the overlapped modes the exchange hides behind the
  steps before its average lands (``T`` = ``--dilocox-overlap-steps``, at most H): round time =
  H * step + max(0, exchange - T * step); ``sync`` mode adds the whole exchange. Codec compute (measured 1.3-2.1%
  of a round's compute on CPU) is ignored. With the distributed optimizer the outer shard of a
  matrix is modelled as (m / DP_in, n); the real shard is a flat range cut across tensors.
* Throughput ratio = (H * AllReduce step) / DiLoCoX round time, at equal tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_dilocox.config import CompressionConfig, DiLoCoXConfig
from megatron_dilocox.payload import HANDSHAKE_BYTES, codec_bytes

GIB = 2**30


def gbps_to_bytes_per_s(gbps: float) -> float:
    return gbps * 1e9 / 8


@dataclass
class ModelShape:
    """A megatron-core GPT (local spec), in Megatron-LM flag terms."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    seq_length: int
    ffn_hidden_size: int | None = None  # default 4 h
    num_query_groups: int | None = None  # default: one per head
    max_position_embeddings: int | None = None  # default seq_length
    position_embedding_type: str = "learned_absolute"
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    disable_bias_linear: bool = False
    normalization: str = "LayerNorm"
    make_vocab_size_divisible_by: int = 128

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden size {self.hidden_size} not divisible by heads {self.num_attention_heads}")


def padded_vocab(vocab: int, multiple_of: int, tp: int) -> int:
    m = math.lcm(multiple_of, tp)
    return -(-vocab // m) * m


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor as a rank holds it: (out, in) for matrices, (n,) for vectors."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def layer_tensors(m: ModelShape, tp: int = 1) -> list[Tensor]:
    """Parameters of one transformer layer on one TP rank (column-parallel outputs / tp)."""
    h, f = m.hidden_size, m.ffn_hidden_size
    kv = (h // m.num_attention_heads) * m.num_query_groups
    qkv_out, fc1_out = h + 2 * kv, f * (2 if m.swiglu else 1)
    bias = not m.disable_bias_linear

    def ln(prefix):
        ts = [Tensor(prefix + ".weight", (h,))]
        return ts + ([Tensor(prefix + ".bias", (h,))] if m.normalization == "LayerNorm" else [])

    ts = ln("input_layernorm") + [Tensor("qkv.weight", (qkv_out // tp, h))]
    ts += [Tensor("qkv.bias", (qkv_out // tp,))] if bias else []
    ts += [Tensor("proj.weight", (h, h // tp))] + ([Tensor("proj.bias", (h,))] if bias else [])
    ts += ln("pre_mlp_layernorm") + [Tensor("fc1.weight", (fc1_out // tp, h))]
    ts += [Tensor("fc1.bias", (fc1_out // tp,))] if bias else []
    ts += [Tensor("fc2.weight", (h, f // tp))] + ([Tensor("fc2.bias", (h,))] if bias else [])
    return ts


def stage_tensors(m: ModelShape, tp: int, pp: int, stage: int) -> list[Tensor]:
    """Parameters of one (TP rank, pipeline stage); even split of layers over stages."""
    if m.num_layers % pp:
        raise ValueError(f"--num-layers {m.num_layers} not divisible by --pipeline-model-parallel-size {pp}")
    h, v = m.hidden_size, padded_vocab(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    ts: list[Tensor] = []
    if stage == 0:
        ts.append(Tensor("word_embeddings", (v // tp, h)))
        if m.position_embedding_type == "learned_absolute":
            ts.append(Tensor("position_embeddings", (m.max_position_embeddings, h)))
    for _ in range(m.num_layers // pp):
        ts += layer_tensors(m, tp)
    if stage == pp - 1:
        ts.append(Tensor("final_layernorm.weight", (h,)))
        if m.normalization == "LayerNorm":
            ts.append(Tensor("final_layernorm.bias", (h,)))
        if m.untie_embeddings_and_output_weights or pp > 1:  # tied + PP>1: a copy on the last stage
            ts.append(Tensor("output_layer", (v // tp, h)))
    return ts


def outer_tensors(m: ModelShape, tp: int, pp: int, stage: int) -> list[Tensor]:
    """The stage's parameters in the DiLoCoX outer loop: all but a tied embedding's copy on the
    last stage (training/dilocox.py mirrors it from the first stage instead of sending it)."""
    ts = stage_tensors(m, tp, pp, stage)
    if stage == pp - 1 and pp > 1 and not m.untie_embeddings_and_output_weights:
        ts = [t for t in ts if t.name != "output_layer"]
    return ts


def param_count(m: ModelShape, tp: int = 1) -> int:
    """Unique parameters of the model (the formula of the module docstring)."""
    h, f, L = m.hidden_size, m.ffn_hidden_size, m.num_layers
    v = padded_vocab(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    kv = (h // m.num_attention_heads) * m.num_query_groups
    g = 2 if m.swiglu else 1
    ln = 2 * h if m.normalization == "LayerNorm" else h
    b = 0 if m.disable_bias_linear else 1
    per_layer = (ln + h * (h + 2 * kv) + b * (h + 2 * kv) + h * h + b * h + ln
                 + h * f * g + b * f * g + f * h + b * h)
    emb = v * h + (m.max_position_embeddings * h if m.position_embedding_type == "learned_absolute" else 0)
    out = v * h if m.untie_embeddings_and_output_weights else 0
    return emb + L * per_layer + ln + out


# -- the plan --------------------------------------------------------------------------------

@dataclass
class Layout:
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


OUTER_BYTES_PER_PARAM = {"delay": 20, "eager": 20, "delay-naive": 20, "sync": 16}
"""Peak outer-state bytes per parameter of the outer shard, as ``outer/sync.py`` holds it: fp32
base and Nesterov momentum (8); in delay modes the round start (4) and the pseudo-gradient in
flight (4) live through the round, and at a boundary the new pseudo-gradient (4) meets the
previous round's average (4 of the 8 already counted) - 20 at peak, 16 between boundaries; in
sync mode the pseudo-gradient and its average exist only at the boundary (8 + 8). Error feedback
adds its fp32 residual (4), and ``keep_unsent`` in sync mode a round start (4). Codec buffers
(factors, payloads) are not counted."""


@dataclass
class Plan:
    params: int
    params_per_rank: int
    outer_shard_params: int
    dp_in: int
    num_microbatches: int
    memory: dict[str, float] = field(default_factory=dict)  # bytes on one GPU
    host_memory: dict[str, float] = field(default_factory=dict)  # bytes in host memory per GPU
    gpu_bytes: float = 0.0
    fits: bool = False
    step: dict[str, float] = field(default_factory=dict)  # seconds
    allreduce: dict[str, float] = field(default_factory=dict)
    dilocox: dict[str, float] = field(default_factory=dict)
    ratio: float = 0.0


def activation_bytes(m: ModelShape, lay: Layout) -> tuple[float, float, int]:
    """(full activations of one layer, kept layer input, layers per stage), per micro-batch."""
    s, b, h, a, t = m.seq_length, lay.micro_batch_size, m.hidden_size, m.num_attention_heads, lay.tp
    full_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    per_stage = m.num_layers // lay.pp
    scale = 1 if lay.bf16 else 2
    return scale * full_layer, scale * 2 * s * b * h, per_stage


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


def plan(m: ModelShape, lay: Layout, d: DiLoCoXConfig, comp: CompressionConfig, mach: Machine) -> Plan:
    """The plan of a model, layout, DiLoCoX and compression settings (pretrain_gpt.py's configs) and machine."""
    tp, pp, c = lay.tp, lay.pp, d.clusters
    if mach.gpus_per_cluster % (tp * pp):
        raise ValueError(f"--gpus-per-cluster {mach.gpus_per_cluster} not divisible by TP x PP = {tp * pp}")
    if d.sync_mode not in OUTER_BYTES_PER_PARAM:
        raise ValueError(f"--dilocox-sync-mode {d.sync_mode!r}: expected one of {sorted(OUTER_BYTES_PER_PARAM)}")
    dp_in = mach.gpus_per_cluster // (tp * pp)
    per_step = lay.micro_batch_size * dp_in * c
    if lay.global_batch_size % per_step:
        raise ValueError(f"--global-batch-size {lay.global_batch_size} not divisible by micro batch x "
                         f"DP_in x clusters = {per_step}")
    nmb = lay.global_batch_size // per_step

    stages = [stage_tensors(m, tp, pp, k) for k in range(pp)]
    stage_numel = [sum(t.numel for t in ts) for ts in stages]
    n_rank = max(stage_numel)
    outer_stages = [outer_tensors(m, tp, pp, k) for k in range(pp)]
    shard_div = dp_in if lay.use_distributed_optimizer else 1
    n_outer = max(sum(t.numel for t in ts) for ts in outer_stages) / shard_div
    p = Plan(params=param_count(m, tp), params_per_rank=n_rank, outer_shard_params=math.ceil(n_outer),
             dp_in=dp_in, num_microbatches=nmb)

    full_layer, inputs, per_stage = activation_bytes(m, lay)
    in_flight = min(pp, nmb)
    if lay.recompute_full:
        act = inputs * per_stage * in_flight + full_layer
    else:
        act = full_layer * per_stage * in_flight
    adam = (12 if lay.bf16 else 8) * n_rank / (dp_in if lay.use_distributed_optimizer else 1)
    own_start = d.sync_mode == "sync" and comp.keep_unsent  # sync keeps no round start of its own otherwise
    outer = (OUTER_BYTES_PER_PARAM[d.sync_mode] + 4 * comp.error_feedback + 4 * own_start) * n_outer if c > 1 else 0.0
    p.memory = dict(
        weights=(2 if lay.bf16 else 4) * n_rank, grads=4 * n_rank, inner_optimizer=adam,
        outer_state=0.0 if d.offload_outer_state else outer, activations=act,
    )
    p.host_memory = dict(outer_state=outer if d.offload_outer_state else 0.0)
    p.gpu_bytes = sum(p.memory.values())
    p.fits = p.gpu_bytes <= mach.gpu_memory_gib * GIB

    p.step = step_time(m, lay, mach, c, dp_in, nmb, n_rank)
    step = p.step["total"]

    inter_bw = gbps_to_bytes_per_s(mach.inter_bandwidth_gbps)
    ranks_on_link = mach.gpus_per_cluster if mach.inter_link == "shared" else 1
    # AllReduce: per rank, its 1/DP_in piece of the fp32 gradient, all-reduced across clusters.
    ar_rank = [2 * (c - 1) / c * 4 * n / dp_in for n in stage_numel]
    ar_link = sum(ar_rank) * tp * dp_in if ranks_on_link > 1 else max(ar_rank)
    ar_time = ar_link / inter_bw
    p.allreduce = dict(bytes_per_rank_per_step=max(ar_rank), per_stage=ar_rank, link_bytes_per_step=ar_link,
                       comm=ar_time, step=step + ar_time)

    # DiLoCoX: payload of each stage's outer shard.
    def shard(ts):
        out = []
        for t in ts:
            if shard_div > 1:
                out.append((math.ceil(t.shape[0] / shard_div),) + t.shape[1:])
            else:
                out.append(t.shape)
        return out

    payload = [codec_bytes(shard(ts), comp) for ts in outer_stages]
    # Once, at the end (--dilocox-flush-residual): the residual int8, after its own handshake.
    flush = [0] * len(outer_stages)
    if comp.flush_residual:
        flush = [codec_bytes(shard(ts), comp.flush_config()) + HANDSHAKE_BYTES for ts in outer_stages]
    wire = (lambda x: 2 * (c - 1) / c * x) if comp.codec == "none" else (lambda x: (c - 1) * x)
    sent = [wire(x) for x in payload]
    dl_link = sum(sent) * tp * dp_in if ranks_on_link > 1 else max(sent)
    exchange = dl_link / inter_bw
    h_steps = d.local_steps
    compute_round = h_steps * step
    window = 0 if d.sync_mode == "sync" else min(d.landing or h_steps, h_steps) * step
    rnd = compute_round + max(0.0, exchange - window)  # training waits for what the window does not hide
    p.dilocox = dict(payload_per_rank=max(payload), payload_per_stage=payload,
                     flush_per_rank=max(flush), flush_per_stage=flush,
                     sent_per_rank_per_round=max(sent), sent_per_stage=sent,
                     bytes_per_rank_per_step=max(sent) / h_steps, link_bytes_per_round=dl_link,
                     exchange=exchange, round_compute=compute_round, round=rnd,
                     step=rnd / h_steps, hidden=float(exchange <= window),
                     dense_bytes=4 * math.ceil(n_outer))
    p.ratio = h_steps * p.allreduce["step"] / rnd
    return p


def step_time(m: ModelShape, lay: Layout, mach: Machine, clusters: int, dp_in: int, nmb: int,
              n_rank: int) -> dict[str, float]:
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
    return dict(matmul=nmb * max(matmul), elementwise=nmb * elementwise, tp_comm=nmb * tp_comm, p2p=nmb * p2p * (pp > 1),
                pipeline=pipeline, cores_bound=shared, compute=compute,
                bubble_factor=pipeline / (nmb * max(tau)) - 1, intra_allreduce=intra, total=compute + intra,
                tokens_per_step=lay.global_batch_size * s)


def _fmt_bytes(x: float) -> str:
    for unit, div in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= div:
            return f"{x / div:,.2f} {unit}"
    return f"{x:,.0f} B"


def _fmt_s(x: float) -> str:
    return f"{x * 1e3:,.1f} ms" if x < 1 else f"{x:,.2f} s"


def report(p: Plan, m: ModelShape, lay: Layout, d: DiLoCoXConfig, comp: CompressionConfig, mach: Machine) -> str:
    """The plan as text, one figure a line."""
    L = [
        f"parameters: {p.params:,} ({p.params / 1e9:.3f} B); padded vocab "
        f"{padded_vocab(m.vocab_size, m.make_vocab_size_divisible_by, lay.tp):,}",
        f"layout: {d.clusters} clusters x (TP {lay.tp} x PP {lay.pp} x DP_in {p.dp_in}) = "
        f"{d.clusters * mach.gpus_per_cluster} {'CPU processes' if mach.cpu_cores else 'GPUs'}; {p.num_microbatches} micro-batches per step",
        f"parameters per GPU (largest stage): {p.params_per_rank:,}; outer shard {p.outer_shard_params:,}",
        "memory per GPU:",
    ]
    L += [f"  {k:<16} {_fmt_bytes(v):>14}" for k, v in p.memory.items()]
    L += [f"  {'total':<16} {_fmt_bytes(p.gpu_bytes):>14} of {mach.gpu_memory_gib:g} GiB: "
          f"{'fits' if p.fits else 'DOES NOT FIT'} (no allowance for context/fragmentation)"]
    if p.host_memory["outer_state"]:
        L += [f"host memory per GPU (pinned, --dilocox-offload-outer-state): outer_state "
              f"{_fmt_bytes(p.host_memory['outer_state'])}"]
    s = p.step
    L += [
        f"step: matmul {_fmt_s(s['matmul'])}"
        + (f" + element-wise {_fmt_s(s['elementwise'])}" if mach.cpu_cores else "")
        + f" + TP all-reduce {_fmt_s(s['tp_comm'])} + pipeline p2p "
        f"{_fmt_s(s['p2p'])}, bubble {s['bubble_factor']:.3f} -> {_fmt_s(s['pipeline'])}"
        + (f", cores bound {_fmt_s(s['cores_bound'])}" if mach.cpu_cores else "")
        + f"; + intra-cluster all-reduce {_fmt_s(s['intra_allreduce'])} = {_fmt_s(s['total'])} "
        f"({s['tokens_per_step']:,.0f} tokens)",
        f"AllReduce baseline: {_fmt_bytes(p.allreduce['bytes_per_rank_per_step'])} per rank per step across "
        f"clusters, link time {_fmt_s(p.allreduce['comm'])} -> step {_fmt_s(p.allreduce['step'])}",
        f"DiLoCoX ({comp.codec}, {comp.bits}-bit, "
        f"{f'density {comp.topk_density:g}' if comp.codec == 'topk' else f'rank {comp.rank}'}, "
        f"H {d.local_steps}, {d.sync_mode}{f', lands after {d.landing}' if d.landing else ''}): "
        f"payload {p.dilocox['payload_per_rank']:,} B per rank per round "
        f"(dense fp32 {p.dilocox['dense_bytes']:,} B), {_fmt_bytes(p.dilocox['bytes_per_rank_per_step'])} "
        f"per rank per step"
        + (f"; final flush {p.dilocox['flush_per_rank']:,} B per rank, once" if comp.flush_residual else ""),
        f"  exchange {_fmt_s(p.dilocox['exchange'])} vs round compute {_fmt_s(p.dilocox['round_compute'])}"
        f"{f' (overlap window {min(d.landing, d.local_steps)} steps)' if d.landing else ''}"
        f" ({'hidden' if p.dilocox['hidden'] else 'NOT hidden'}) -> round {_fmt_s(p.dilocox['round'])}",
        f"throughput DiLoCoX / AllReduce: {p.ratio:,.1f}x",
    ]
    return "\n".join(L)
