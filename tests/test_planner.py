"""Planner arithmetic (megatron_dilocox/planner/, tools/plan.py) against hand sums and measurements."""
import math

import pytest

from megatron_dilocox import planner as pl
from megatron_dilocox.config import CompressionConfig, DiLoCoXConfig
from megatron_dilocox.payload import codec_bytes

# The quickstart model (examples/quickstart_gpt.sh): 4 layers, hidden 256, 4 heads, ffn 4h,
# seq 128 with learned positions, vocab 4096 (already a multiple of 128), tied output.
QS = dict(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=4096, seq_length=128)


def test_quickstart_param_count_by_hand():
    h, f, v = 256, 1024, 4096
    layer = (2 * h                      # input layernorm
             + h * 3 * h + 3 * h        # QKV + bias
             + h * h + h                # projection + bias
             + 2 * h                    # pre-MLP layernorm
             + h * f + f                # fc1 + bias
             + f * h + h)               # fc2 + bias
    assert layer == 789_760
    total = v * h + 128 * h + 4 * layer + 2 * h
    assert total == 4_240_896
    assert pl.param_count(pl.ModelShape(**QS)) == total
    # Each stage's tensors add up: PP2 = first stage (embeddings + 2 layers) + last (2 layers + LN + tied copy).
    m = pl.ModelShape(**QS)
    stages = [sum(t.numel for t in pl.stage_tensors(m, 1, 2, k)) for k in range(2)]
    assert stages[0] + stages[1] - v * h == total


def test_swiglu_untied_gqa_vocab_padding():
    m = pl.ModelShape(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, vocab_size=1000,
                      seq_length=16, ffn_hidden_size=96, swiglu=True, untie_embeddings_and_output_weights=True,
                      position_embedding_type="rope")
    h, kv, f = 64, 8 * 2, 96
    v = pl.padded_vocab(1000, 128, 3)
    assert v == 1152  # lcm(128, 3) = 384
    layer = 2 * h + h * (h + 2 * kv) + (h + 2 * kv) + h * h + h + 2 * h + h * 2 * f + 2 * f + f * h + h
    assert pl.param_count(m, tp=3) == v * h + 2 * layer + 2 * h + v * h
    assert sum(t.numel for t in pl.layer_tensors(m)) == layer


def test_codec_bytes_match_measured_quickstart_last_stage():
    """docs/compression.md: last pipeline stage of the quickstart model, 2 clusters x PP2, measured
    when that stage still sent its copy of the tied embedding (the codec formula on those shapes)."""
    shapes = [t.shape for t in pl.stage_tensors(pl.ModelShape(**QS), tp=1, pp=2, stage=1)]
    assert sum(math.prod(s) for s in shapes) == 2_628_608
    assert codec_bytes(shapes, CompressionConfig(codec="none")) == 10_514_432
    # Steady-state rounds in runs/compression/*.jsonl send exactly these bytes; the docs table
    # reports ceil((10 rounds + 32 handshake bytes) / 10): 55,524 and 109,284.
    per_round = {(4, "lowrank-quantize"): 55_520, (8, "lowrank-quantize"): 109_280,
                 (32, "lowrank"): 430_160, (8, "quantize"): 2_669_720, (4, "quantize"): 1_355_416}
    docs = {(4, "lowrank-quantize"): 55_524, (8, "lowrank-quantize"): 109_284,
            (32, "lowrank"): 430_164, (8, "quantize"): 2_669_724, (4, "quantize"): 1_355_420}
    for (bits, codec), expected in per_round.items():
        got = codec_bytes(shapes, CompressionConfig(codec=codec, bits=None if bits == 32 else bits, rank=8))
        assert got == expected, (codec, bits)
        assert math.ceil((10 * got + 32) / 10) == docs[bits, codec]


@pytest.mark.parametrize("bits", [2, 4])
def test_topk_codec_bytes_are_the_reducers(bits):
    """One topk round of the quickstart's last-stage outer shard sends what the planner says."""
    import torch

    from megatron_dilocox.outer.compression import CompressedReducer

    shapes = [t.shape for t in pl.outer_tensors(pl.ModelShape(**QS), 1, 2, 1)]
    red = CompressedReducer(shapes, CompressionConfig(codec="topk", bits=bits))
    red([torch.ones(red.numel)], None)
    assert codec_bytes(shapes, CompressionConfig(codec="topk", bits=bits)) == red.last_stats["payload_bytes"]


def test_final_flush_bytes_match_the_measured_quickstart():
    """The quickstart's last record (README table, 2026-12-02, density 1/32) sent 1,661,924 B from
    the last stage: its drained topk round (57,132 B) and the int8 flush of the residual, whose bytes the
    plan reports once; without error feedback there is no flush."""
    lay = pl.Layout(tp=1, pp=2, micro_batch_size=4, global_batch_size=16)
    mach = pl.Machine(gpus_per_cluster=2)
    p = pl.plan(pl.ModelShape(**QS), lay, DiLoCoXConfig(), CompressionConfig(), mach)
    assert p.dilocox.payload_per_stage[1] == 57_132
    assert p.dilocox.flush_per_stage[1] == 1_661_924 - 57_132
    none = pl.plan(pl.ModelShape(**QS), lay, DiLoCoXConfig(), CompressionConfig(codec="none"), mach)
    assert none.dilocox.flush_per_rank == 0


def test_tied_copy_stays_out_of_the_outer_loop():
    m = pl.ModelShape(**QS)
    last, outer = pl.stage_tensors(m, 1, 2, 1), pl.outer_tensors(m, 1, 2, 1)
    assert [t.name for t in last if t not in outer] == ["output_layer"]
    assert sum(t.numel for t in outer) == 2_628_608 - 4096 * 256
    assert pl.outer_tensors(m, 1, 2, 0) == pl.stage_tensors(m, 1, 2, 0)
    untied = pl.ModelShape(**QS, untie_embeddings_and_output_weights=True)
    assert pl.outer_tensors(untied, 1, 2, 1) == pl.stage_tensors(untied, 1, 2, 1)
    lay = pl.Layout(tp=1, pp=2, micro_batch_size=4, global_batch_size=16)
    mach = pl.Machine(gpus_per_cluster=2, gpu_tflops=1.0, intra_bandwidth_gbps=8.0, inter_bandwidth_gbps=0.01)
    d = (DiLoCoXConfig(clusters=2, local_steps=10), CompressionConfig(codec="quantize", bits=4))
    p = pl.plan(m, lay, *d, mach)
    assert p.dilocox.payload_per_stage == [
        codec_bytes([t.shape for t in pl.outer_tensors(m, 1, 2, k)], CompressionConfig(codec="quantize", bits=4))
        for k in range(2)]
    assert p.outer_shard_params == sum(t.numel for t in pl.stage_tensors(m, 1, 2, 0))  # the largest outer shard


def test_memory_arithmetic_small_case():
    m = pl.ModelShape(**QS)
    lay = pl.Layout(tp=1, pp=2, micro_batch_size=4, global_batch_size=32, use_distributed_optimizer=True, bf16=True)
    d = (DiLoCoXConfig(clusters=2, local_steps=20, sync_mode="delay"), CompressionConfig(codec="lowrank-quantize"))
    mach = pl.Machine(gpus_per_cluster=4, gpu_memory_gib=1)
    p = pl.plan(m, lay, *d, mach)
    n = 1_048_576 + 32_768 + 2 * 789_760  # first stage is the larger one
    assert p.dp_in == 2 and p.num_microbatches == 2 and p.params_per_rank == n
    assert p.memory.weights == 2 * n and p.memory.grads == 4 * n
    assert p.memory.inner_optimizer == 12 * n / 2
    # delay mode: base, momentum, round start, in-flight pseudo-gradient + the next one at a boundary
    assert p.memory.outer_state == (4 + 4 + 4 + 4 + 4) * n / 2 and p.memory.host_outer_state == 0
    s, b, h, a = 128, 4, 256, 4
    per_layer = s * b * h * (34 + 5 * a * s / h)
    assert p.memory.activations == per_layer * 2 * 2  # 2 layers/stage x min(PP, m) = 2 in flight
    assert p.fits
    rec = pl.plan(m, pl.Layout(tp=1, pp=2, micro_batch_size=4, global_batch_size=32, bf16=True,
                               recompute_full=True), *d, mach)
    assert rec.memory.activations == 2 * s * b * h * 2 * 2 + per_layer


def test_outer_state_offload_sync_and_error_feedback():
    m = pl.ModelShape(**QS)
    lay = pl.Layout(tp=1, pp=2, micro_batch_size=4, global_batch_size=32, use_distributed_optimizer=True, bf16=True)
    mach = pl.Machine(gpus_per_cluster=4)
    shard = (1_048_576 + 32_768 + 2 * 789_760) / 2
    cases = {  # (sync mode, error feedback, offload): outer bytes per param of the shard
        ("delay", False, False): 20, ("delay", True, False): 24, ("sync", False, False): 16,
        ("sync", True, True): 24, ("delay", False, True): 20,  # sync + error feedback: keep-unsent's round start
    }
    base = pl.plan(m, lay, DiLoCoXConfig(clusters=2), CompressionConfig(), mach)
    for (mode, ef, off), per_param in cases.items():
        p = pl.plan(m, lay, DiLoCoXConfig(clusters=2, sync_mode=mode, offload_outer_state=off),
                    CompressionConfig(error_feedback=ef), mach)
        gpu, host = (0, per_param * shard) if off else (per_param * shard, 0)
        assert (p.memory.outer_state, p.memory.host_outer_state) == (gpu, host), (mode, ef, off)
        others = sum(v for k, v in p.memory.on_gpu().items() if k != "outer_state")
        assert others == sum(v for k, v in base.memory.on_gpu().items() if k != "outer_state")
        assert p.memory.gpu_total == others + gpu
    # one cluster: no outer loop, no outer state
    one = pl.plan(m, pl.Layout(tp=1, pp=2, micro_batch_size=4, global_batch_size=32), DiLoCoXConfig(clusters=1),
                  CompressionConfig(),
                  pl.Machine(gpus_per_cluster=2))
    assert one.memory.outer_state == 0 and one.allreduce.comm == 0 and one.ratio == 1


def test_matmul_flops_by_hand():
    m = pl.ModelShape(**QS)
    weights = 768 * 256 + 256 * 256 + 1024 * 256 + 256 * 1024  # qkv, proj, fc1, fc2
    layer = 2 * weights + 2 * 2 * 128 * 256  # + scores and weighted values
    assert layer == 1_703_936 and pl.layer_matmul_flops(m) == layer
    logits = 3 * 2 * 4096 * 256
    assert pl.stage_flops_per_token(m, 1, 1, 0) == 4 * 3 * layer + logits
    # PP2: the first stage has 2 layers and no logits; full recompute: the layers' forward x 4
    assert pl.stage_flops_per_token(m, 1, 2, 0) == 2 * 3 * layer
    assert pl.stage_flops_per_token(m, 1, 2, 1, recompute_full=True) == 2 * 4 * layer + logits
    # TP2 halves every product (the vocabulary 4096 is already a multiple of lcm(128, 2))
    assert pl.stage_flops_per_token(m, 2, 1, 0) == (4 * 3 * layer + logits) / 2


def test_step_time_gpu_pipeline_by_hand():
    m = pl.ModelShape(**QS)
    lay = pl.Layout(tp=2, pp=2, micro_batch_size=4, global_batch_size=64, bf16=True)
    mach = pl.Machine(gpus_per_cluster=8, gpu_tflops=1.0, intra_bandwidth_gbps=8.0, tp_bandwidth_gbps=16.0)
    p = pl.plan(m, lay, DiLoCoXConfig(clusters=2), CompressionConfig(codec="none"), mach)
    # DP_in = 8 / 4 = 2, micro-batches = 64 / (4 x 2 x 2) = 4, tokens per micro-batch 512
    assert p.dp_in == 2 and p.num_microbatches == 4
    layer = 1_703_936 / 2
    mm0 = 2 * 3 * layer * 512 / 1e12
    mm1 = (2 * 3 * layer + 3 * 2 * 4096 * 256 / 2) * 512 / 1e12
    tp = 4 * 2 * (2 * 1 / 2) * 512 * 256 * 2 / 2e9  # 4 all-reduces/layer, ring 2(t-1)/t, bf16, 16 Gbps
    p2p = 2 * 512 * 256 * 2 / 1e9  # forward activation out + gradient in, 8 Gbps
    tau0, tau1 = mm0 + tp + p2p, mm1 + tp
    pipeline = 3 * max(tau0, tau1) + tau0 + tau1
    assert math.isclose(p.step.pipeline, pipeline) and math.isclose(p.step.compute, pipeline)
    assert math.isclose(p.step.bubble_factor, pipeline / (4 * tau1) - 1)
    n = p.params_per_rank
    assert math.isclose(p.step.intra_allreduce, 2 * 1 / 2 * 4 * n / 1e9)
    assert math.isclose(p.step.total, pipeline + p.step.intra_allreduce)


def test_step_time_cpu_mode_by_hand():
    m = pl.ModelShape(**QS)
    per_token = 4 * 3 * 1_703_936 + 3 * 2 * 4096 * 256
    tokens = 16 * 128
    one = pl.Machine(gpus_per_cluster=1, cpu_cores=2, cpu_gflops_1thread=10.0, cpu_gflops_all_threads=16.0)
    lay = pl.Layout(micro_batch_size=4, global_batch_size=16)
    p = pl.plan(m, lay, DiLoCoXConfig(clusters=1), CompressionConfig(), one)
    assert math.isclose(p.step.total, per_token * tokens / 16e9)  # one process: all threads
    # element-wise work: 4 layers x 2048 tokens x 256 hidden x 100 ns at one thread, sped up 1.6x
    # by the threads of a single process; every TP rank does all of it, so TP2 halves only the matmuls
    ew = pl.Machine(gpus_per_cluster=1, cpu_cores=2, cpu_gflops_1thread=10.0, cpu_gflops_all_threads=16.0,
                    cpu_elementwise_ns=100.0)
    p_ew = pl.plan(m, lay, DiLoCoXConfig(clusters=1), CompressionConfig(), ew)
    assert math.isclose(p_ew.step.elementwise, 100e-9 * tokens * 256 * 4 / 1.6)
    assert math.isclose(p_ew.step.total, p.step.total + p_ew.step.elementwise)
    tp2 = pl.Machine(gpus_per_cluster=2, cpu_cores=2, cpu_gflops_1thread=10.0, cpu_gflops_all_threads=16.0,
                     cpu_elementwise_ns=100.0, tp_bandwidth_gbps=8.0)
    p_tp2 = pl.plan(m, pl.Layout(tp=2, micro_batch_size=4, global_batch_size=16), DiLoCoXConfig(clusters=1),
                    CompressionConfig(), tp2)
    tp_comm = 4 * 4 * 2 * 0.5 * 512 * 256 * 4 / 1e9  # 4 layers x 4 all-reduces per micro-batch
    per_mb = pl.stage_flops_per_token(m, 2, 1, 0) * 512 / 10e9 + 100e-9 * 512 * 256 * 4 + tp_comm
    assert math.isclose(p_tp2.step.total, 4 * per_mb)
    with pytest.raises(ValueError, match="--cpu-elementwise-ns"):
        pl.plan(m, lay, DiLoCoXConfig(clusters=1), CompressionConfig(), pl.Machine(gpus_per_cluster=1, cpu_cores=2,
                cpu_gflops_1thread=10.0, cpu_gflops_all_threads=16.0, cpu_elementwise_ns=-1.0))
    # 2 clusters x PP2 on 4 single-threaded processes sharing 2 cores: the cores bound wins
    four = pl.Machine(gpus_per_cluster=2, cpu_cores=2, cpu_gflops_1thread=10.0, cpu_gflops_all_threads=16.0,
                      intra_bandwidth_gbps=8.0)
    lay2 = pl.Layout(pp=2, micro_batch_size=4, global_batch_size=16)
    q = pl.plan(m, lay2, DiLoCoXConfig(clusters=2), CompressionConfig(), four)
    assert math.isclose(q.step.cores_bound, per_token * tokens / 10e9 / 2)
    mm = [2 * 3 * 1_703_936 * 512 / 10e9, (2 * 3 * 1_703_936 + 3 * 2 * 4096 * 256) * 512 / 10e9]
    tau = [mm[0] + 2 * 512 * 256 * 4 / 1e9, mm[1]]
    assert math.isclose(q.step.pipeline, max(tau) + sum(tau))  # 2 micro-batches per cluster
    assert q.step.cores_bound > q.step.pipeline and q.step.total == q.step.cores_bound


def test_step_and_ratio_arithmetic():
    m = pl.ModelShape(**QS)
    lay = pl.Layout(tp=1, pp=1, micro_batch_size=1, global_batch_size=4)
    mach = pl.Machine(gpus_per_cluster=2, gpu_tflops=1.0, intra_bandwidth_gbps=8.0, inter_bandwidth_gbps=8.0)
    # lands at the boundary
    d = (DiLoCoXConfig(clusters=2, local_steps=10, overlap_steps=10), CompressionConfig(codec="none"))
    p = pl.plan(m, lay, *d, mach)
    n = p.params_per_rank
    assert math.isclose(p.step.compute, pl.stage_flops_per_token(m, 1, 1, 0) * 128 / 1e12)  # 1 micro-batch
    assert math.isclose(p.step.intra_allreduce, 2 * 0.5 * 4 * n / 1e9)
    # AllReduce: each rank sends 2(C-1)/C of its 1/DP_in gradient piece; 2 ranks share the link.
    assert math.isclose(p.allreduce.comm, 2 * (1 * 4 * n / 2) / 1e9)
    assert math.isclose(p.dilocox.exchange, 2 * (1 * 4 * n) / 1e9)
    assert math.isclose(p.ratio, 10 * p.allreduce.step / max(10 * p.step.total, p.dilocox.exchange))
    # The default lands 1 step into the next round: only 1 step's compute hides the exchange.
    early = pl.plan(m, lay, DiLoCoXConfig(clusters=2, local_steps=10), CompressionConfig(codec="none"), mach)
    window = p.step.total
    assert p.dilocox.exchange > window and not early.dilocox.hidden and p.dilocox.hidden
    assert math.isclose(early.dilocox.round, 10 * p.step.total + p.dilocox.exchange - window)


def test_cli_quickstart_and_preset(capsys):
    import tools.plan as cli
    assert cli.main(["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
                     "--vocab-size", "4096", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "4",
                     "--global-batch-size", "16", "--dilocox-clusters", "2", "--gpus-per-cluster", "2"]) == 0
    assert "parameters: 4,240,896" in capsys.readouterr().out
    assert cli.main(["--preset", "paper-107b"]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "paper reports: 357x" in out
    p = pl.plan(*cli.configs(cli.resolve(["--preset", "paper-107b"])))
    assert 100e9 < p.params < 110e9 and p.fits


def test_cli_plans_a_launch_with_its_own_flags(capsys):
    import tools.plan as cli
    vanilla = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
               "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", "10", "--lr", "1e-3",
               "--pipeline-model-parallel-size", "2", "--mock-data", "--vocab-size", "4096"]
    launch = vanilla + ["--dilocox", "--dilocox-local-steps", "10", "--dilocox-sync-mode", "sync"]
    ns = cli.resolve(["--gpus-per-cluster", "2", "--", *launch, "--not-a-flag", "1"])
    assert "does not know --not-a-flag" in capsys.readouterr().err
    model, lay, d, _, mach = cli.configs(ns)
    assert (lay.pp, lay.micro_batch_size, lay.global_batch_size, d.clusters, d.local_steps, d.sync_mode,
            model.vocab_size) == (2, 4, 16, 2, 10, "sync", 4096)
    direct = cli.resolve(["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
                          "--seq-length", "128", "--vocab-size", "4096", "--pipeline-model-parallel-size", "2",
                          "--micro-batch-size", "4", "--global-batch-size", "16", "--dilocox-clusters", "2",
                          "--dilocox-local-steps", "10", "--dilocox-sync-mode", "sync", "--gpus-per-cluster", "2"])
    assert pl.plan(*cli.configs(ns)) == pl.plan(*cli.configs(direct))
    # without --dilocox a launch is one cluster
    assert cli.resolve(["--", *vanilla]).dilocox_clusters == 1
    # --check-fits: status 3 and a one-line error when the memory does not fit
    assert cli.main(["--gpu-memory-gib", "0.01", "--check-fits", "--gpus-per-cluster", "2", "--", *launch]) == 3
    assert "does not fit --gpu-memory-gib 0.01" in capsys.readouterr().err


def test_planner_imports_and_plans_without_torch():
    """The planner and payload.py are pure arithmetic: they import and plan where torch is absent."""
    import subprocess
    import sys

    from launch import REPO

    code = ("import sys, tools.plan as cli; from megatron_dilocox import planner as pl; "
            "p = pl.plan(*cli.configs(cli.resolve(['--preset', 'paper-107b']))); "
            "assert 'torch' not in sys.modules and p.fits; print(p.dilocox.payload_per_rank)")
    proc = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) > 0
    blocked = subprocess.run([sys.executable, "-S", "-c", "import torch"], capture_output=True, timeout=60)
    assert blocked.returncode != 0  # -S really leaves torch out
