"""DiLoCoX on real megatron models: C=2 (and C=4) clusters against a single-process reference, global
parameters bit-identical across clusters after every round, and cross-cluster bytes."""

import json
import math

import pytest
import torch

from expected_bytes import int8_flush_bytes
from launch import REPO, read_jsonl, torchrun
from megatron_dilocox.payload import HEADER_BYTES, topk_bytes

H, ITERS = 3, 9
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "3e-3",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
         "--eval-interval", str(H), "--eval-iters", "1",
         "--dilocox", "--dilocox-clusters", "2", "--dilocox-local-steps", str(H), "--dilocox-compression", "none",
         "--dilocox-local-steps-ramp-iters", "0"]  # rounds of H from the start (RAMP below ramps them)
LAYOUTS = {"pp2": ["--pipeline-model-parallel-size", "2"], "tp2": ["--tensor-model-parallel-size", "2"]}
MODES = ("sync", "delay")
# A reduction slowed to 3 s against steps of well under 0.6 s: H must grow to its bound of 6.
ADAPTIVE_H = ["--dilocox-min-local-steps", "2", "--dilocox-max-local-steps", "6", "--dilocox-emulated-delay-s", "3"]
COMPRESSED = ["--dilocox-compression", "lowrank-quantize", "--dilocox-rank", "4", "--dilocox-quant-bits", "4",
              "--dilocox-adaptive", "--dilocox-error-feedback"]
TOPK = ["--dilocox-compression", "topk", "--dilocox-quant-bits", "2", "--dilocox-topk-chunk", "1024"]
# eager with each round's average applied one inner step into the next round.
LANDING = ["--dilocox-sync-mode", "eager", "--dilocox-overlap-steps", "1"]
# H ramped from 1 to 3 over the first 6 iterations: rounds of 1, 1, 2 and 3 steps, then 3
# (boundaries at 1, 2, 4, 7), each average landing one step in where the round is long enough
# (the last at 8: nothing is left to drain at the end); the outer lr warms up from 1 to 1.4 over
# the same 6 iterations (1.067, 1.133 and 1.267 for the rounds ending at 1, 2 and 4, then 1.4).
OUTER_LR = ["--dilocox-outer-lr", "1.4"]
RAMP = ["--dilocox-sync-mode", "delay", "--dilocox-local-steps-ramp-iters", "6", *OUTER_LR,
        "--dilocox-outer-lr-warmup-iters", "6"]
# C = 4 clusters of one rank (overriding MODEL's 2, so that 1/C is neither 1/2 nor 1 - 1/C), each
# round's average applied at the next boundary: a replica trains a whole round from its restart point.
C4_AT_BOUNDARY = ["--dilocox-clusters", "4", "--dilocox-overlap-steps", str(H)]
# topk on C = 4 clusters of one rank (each compresses the whole model, as the reference does),
# each replica keeping its unsent progress, the residuals sent at the end (the defaults, given
# explicitly; the reference to tell them apart turns both off).
TOPK_C4 = ["--dilocox-clusters", "4", "--dilocox-sync-mode", "delay", "--dilocox-compression", "topk",
           "--dilocox-topk-chunk", "1024"]
UNSENT_FLUSH = ["--dilocox-keep-unsent", "--dilocox-flush-residual"]
# A NaN in one parameter of rank 0 (stage 0, or TP rank 0, of cluster 0) before the first boundary,
# and the rounds every rank must skip: delay mode applies that round at the second boundary.
# (Landing at the boundaries, where the scenario checks whether base moved; the mid-round landing's
# skip is checked in tests/test_outer_sync.py.)
NAN_RUNS = {"nan_pp2": (LAYOUTS["pp2"] + ["--dilocox-sync-mode", "delay", "--dilocox-overlap-steps", str(H)],
                        [False, True, False]),
            "nan_tp2": (LAYOUTS["tp2"] + ["--dilocox-sync-mode", "sync"], [True, False, False])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dilocox")
    specs = [{"name": f"{layout}_{mode}", "flags": MODEL + flags + ["--dilocox-sync-mode", mode]}
             for layout, flags in LAYOUTS.items() for mode in MODES]
    specs.append({"name": "compressed", "flags": MODEL + LAYOUTS["pp2"] + COMPRESSED})
    specs.append({"name": "topk", "flags": MODEL + LAYOUTS["pp2"] + TOPK})
    specs.append({"name": "pp2_landing", "flags": MODEL + LAYOUTS["pp2"] + LANDING})
    specs.append({"name": "pp2_ramp", "flags": MODEL + LAYOUTS["pp2"] + RAMP})
    specs.append({"name": "eager_c4", "flags": MODEL + C4_AT_BOUNDARY + ["--dilocox-sync-mode", "eager"]})
    specs.append({"name": "topk_c4_unsent_flush", "flags": MODEL + TOPK_C4 + UNSENT_FLUSH})
    specs.append({"name": "adaptive_h", "flags": MODEL + LAYOUTS["tp2"] + ADAPTIVE_H + ["--train-iters", "18"]})
    # TP1/PP1: DP_in = 2 per cluster, without the distributed optimizer.
    specs.append({"name": "dp2", "flags": MODEL + ["--dilocox-sync-mode", "sync"], "measure_norms": True})
    specs += [{"name": name, "flags": MODEL + flags, "inject_nan": {"rank": 0, "iteration": H}}
              for name, (flags, _) in NAN_RUNS.items()]
    (out / "spec.json").write_text(json.dumps(specs))
    torchrun(4, REPO / "tests" / "scenarios.py", [str(out), str(out / "spec.json")])
    refs = [{"name": mode, "flags": MODEL + ["--dilocox-sync-mode", mode]} for mode in MODES]
    refs.append({"name": "landing", "flags": MODEL + LANDING})
    refs.append({"name": "ramp", "flags": MODEL + RAMP})
    refs.append({"name": "ramp_outer_lr_at_once", "flags": MODEL + RAMP + ["--dilocox-outer-lr-warmup-iters", "0"]})
    refs += [{"name": f"{mode}_c4", "flags": MODEL + C4_AT_BOUNDARY + ["--dilocox-sync-mode", mode]}
             for mode in ("eager", "delay")]
    neither = ["--no-dilocox-keep-unsent", "--no-dilocox-flush-residual"]
    refs += [{"name": "topk_c4", "flags": MODEL + TOPK_C4 + neither},
             {"name": "topk_c4_unsent_flush", "flags": MODEL + TOPK_C4 + UNSENT_FLUSH}]
    (out / "ref.json").write_text(json.dumps(refs))
    torchrun(1, REPO / "tests" / "reference_dilocox.py", [str(out), str(out / "ref.json")])
    return out


def _cluster0_params(out, name, cluster_size=2):
    merged = {}
    for rank in range(cluster_size):
        path = out / f"{name}.params.{rank}.pt"
        if path.exists():
            stage = torch.load(path)
            for key in stage.keys() & merged.keys():  # a tied embedding's copies, bit for bit
                assert torch.equal(stage[key], merged[key]), key
            merged.update(stage)
    return merged


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mode", MODES)
def test_outer_params_match_reference(runs, layout, mode):
    _assert_matches_reference(runs, f"{layout}_{mode}", mode, "delay" if mode == "sync" else "sync")


def test_landing_mid_round_matches_reference(runs):
    _assert_matches_reference(runs, "pp2_landing", "landing", "delay")
    records = read_jsonl(runs / "pp2_landing.metrics.jsonl")
    # Each boundary reports the round that landed during it; the last round is drained at the end.
    assert [r["bytes_sent"] > 0 for r in records if "outer_step" in r] == [False] + [True] * (ITERS // H)


def test_local_steps_ramp_and_outer_lr_warmup_match_reference(runs):
    _assert_matches_reference(runs, "pp2_ramp", "ramp", "ramp_outer_lr_at_once")
    rounds = [r for r in read_jsonl(runs / "pp2_ramp.metrics.jsonl") if "outer_step" in r]
    # The last iteration ends a short round of its own: the replicas' last two steps are sent.
    assert [(r["iteration"], r.get("local_steps")) for r in rounds if not r["drain"]] == \
        [(1, 1), (2, 2), (4, 3), (7, 3), (9, 3)]
    infos = [json.loads((runs / f"pp2_ramp.info.{rank}.json").read_text()) for rank in range(4)]
    assert all(info["hash_checks"] == 5 for info in infos)


def test_eager_at_boundary_matches_reference(runs):
    """eager with C = 4: every replica restarts each round from base - delta / C. The reference
    with delay's restart point (base - delta) is far from it, so a wrong share fails the match."""
    _assert_matches_reference(runs, "eager_c4", "eager_c4", "delay_c4", cluster_size=1)
    infos = [json.loads((runs / f"eager_c4.info.{rank}.json").read_text()) for rank in range(4)]
    assert all(info["hash_checks"] == ITERS // H for info in infos)
    rounds = [r for r in read_jsonl(runs / "eager_c4.metrics.jsonl") if "outer_step" in r]
    assert [r["bytes_sent"] for r in rounds] == [0] + [infos[0]["outer_numel"] * 4] * (ITERS // H)
    assert rounds[-1]["drain"]


def test_keep_unsent_and_flush_on_the_real_model_match_reference(runs):
    """--dilocox-keep-unsent --dilocox-flush-residual with topk: the replicas restart from base
    less their residuals and the end sends every entry of those, int8, as the reference with one
    compressor per replica does; the last record counts the drained round plus the flush."""
    _assert_matches_reference(runs, "topk_c4_unsent_flush", "topk_c4_unsent_flush", "topk_c4", cluster_size=1)
    infos = [json.loads((runs / f"topk_c4_unsent_flush.info.{rank}.json").read_text()) for rank in range(4)]
    assert all(info["hash_checks"] == ITERS // H for info in infos)
    numel = infos[0]["outer_numel"]
    last = [r for r in read_jsonl(runs / "topk_c4_unsent_flush.metrics.jsonl") if "outer_step" in r][-1]
    assert last["drain"] and last["bytes_sent"] == (HEADER_BYTES + topk_bytes(numel, 1024, 1 / 32, 2)
                                                    + int8_flush_bytes(infos[0]["outer_numels"]))


def _assert_matches_reference(runs, name, reference, other_reference, cluster_size=2):
    got = _cluster0_params(runs, name, cluster_size)
    want = torch.load(runs / f"{reference}.reference.pt")
    init = torch.load(runs / f"{reference}.init.pt")
    other = torch.load(runs / f"{other_reference}.reference.pt")
    assert set(got) == set(want) and len(want) > 10

    def distance(a, b):
        return sum(float((a[n] - b[n]).double().pow(2).sum()) for n in want) ** 0.5

    # Adam turns float noise in near-zero gradients (TP reductions add in another order) into
    # lr-sized differences of a few weights, so compare against how far training moved them.
    moved = distance(want, init)
    assert moved > 0.1
    assert distance(got, want) < 1e-3 * moved
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-3, msg=lambda m: f"{name}: {m}")
    # The two modes really differ, so the comparison can tell them apart.
    assert distance(other, want) > 0.05 * moved


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mode", MODES)
def test_global_params_identical_across_clusters_every_round(runs, layout, mode):
    infos = [json.loads((runs / f"{layout}_{mode}.info.{rank}.json").read_text()) for rank in range(4)]
    assert all(info["hash_checks"] == ITERS // H for info in infos)
    # Both clusters evaluate the same global parameters: same validation loss, bit for bit.
    assert len({info["final_val_loss"] for info in infos if info["final_val_loss"] == info["final_val_loss"]}) == 1


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mode", MODES)
def test_cross_cluster_bytes(runs, layout, mode):
    records = read_jsonl(runs / f"{layout}_{mode}.metrics.jsonl")
    rounds = [r for r in records if "outer_step" in r]
    info = json.loads((runs / f"{layout}_{mode}.info.3.json").read_text())
    payload = info["outer_numel"] * 4
    # The last stage's copy of the tied embedding (vocab 200 padded to 256, hidden 64) follows the
    # first stage's and is not sent.
    assert info["param_numel"] - info["outer_numel"] == (256 * 64 if layout == "pp2" else 0)
    assert all(r["cross_cluster_bytes_between_boundaries"] == 0 for r in rounds)
    sent = [r["bytes_sent"] for r in rounds]
    if mode == "sync":
        assert sent == [payload] * (ITERS // H)
    else:  # nothing to apply at the first boundary; the last round is drained at the end
        assert sent == [0] + [payload] * (ITERS // H)
        assert rounds[-1]["drain"]
    assert [r["iteration"] for r in records if "lm_loss" in r] == list(range(1, ITERS + 1))
    assert sum(1 for r in records if "val_loss" in r) == ITERS // H


def test_compressed_rounds(runs):
    """lowrank-quantize: clusters still agree bit for bit after every round, nothing crosses
    between boundaries, and each round sends far less than the dense fp32 shard."""
    infos = [json.loads((runs / f"compressed.info.{rank}.json").read_text()) for rank in range(4)]
    assert all(info["hash_checks"] == ITERS // H for info in infos)
    records = read_jsonl(runs / "compressed.metrics.jsonl")
    rounds = [r for r in records if "outer_step" in r]
    assert all(r["cross_cluster_bytes_between_boundaries"] == 0 for r in rounds)
    # The audit sees the codec's all-gathers too (the first round's payload left by iteration 6).
    assert [r for r in records if "lm_loss" in r][-1]["cross_cluster_bytes"] >= rounds[1]["bytes_sent"] > 0
    applied = [r for r in rounds if r["bytes_sent"]]
    assert len(applied) == ITERS // H
    dense = infos[3]["outer_numel"] * 4
    for r in applied:
        assert r["dense_bytes"] == dense
        assert 0 < r["rel_error"] < 1 and 1 <= r["mean_rank"] <= 4
    # Error feedback is on, so keep-unsent and the final flush are too: the drained last round
    # also sends the residual, int8.
    *steady, drained = applied
    assert all(r["bytes_sent"] < dense / 4 and r["compression_ratio"] > 4 for r in steady)
    drained_round = drained["bytes_sent"] - int8_flush_bytes(infos[3]["outer_numels"])
    assert drained["drain"] and 0 < drained_round < dense / 4


def test_topk_rounds(runs):
    """topk (error feedback, keep-unsent and the final flush on by default): clusters agree bit for
    bit after every round, and each round sends the format's bytes for the last stage's shard (plus
    the handshake, once); the drained last round also sends the residual, int8."""
    infos = [json.loads((runs / f"topk.info.{rank}.json").read_text()) for rank in range(4)]
    assert all(info["hash_checks"] == ITERS // H for info in infos)
    applied = [r for r in read_jsonl(runs / "topk.metrics.jsonl") if "outer_step" in r and r["bytes_sent"]]
    numel = infos[3]["outer_numel"]
    payload = HEADER_BYTES + topk_bytes(numel, 1024, 1 / 32, 2)
    assert [r["bytes_sent"] for r in applied] == [payload + 32] + [payload] * (ITERS // H - 2) + [payload + int8_flush_bytes(infos[3]["outer_numels"])]
    for r in applied:
        assert r["compression_ratio"] == 4 * infos[3]["outer_numel"] / payload > 50
        assert 0 < r["rel_error"] < 1 and r["residual_ratio"] > 0


def test_adaptive_local_steps(runs):
    rounds = [r for r in read_jsonl(runs / "adaptive_h.metrics.jsonl") if "outer_step" in r and not r["drain"]]
    # H starts at 3. Each reduction carries the comm time of the one before it, and in delay mode
    # it is applied a round after its launch: the rounds at 3 and 6 have no exchange time to
    # decide from (H stays), the one at 9 has the first reduction's; from there on H is what the
    # slowest exchange (3 s emulated) and step over every rank call for: how far it grows depends
    # on the machine's speed, the rule and the schedule that follows from it do not.
    assert [(r["iteration"], r["local_steps"]) for r in rounds[:2]] == [(3, 3), (6, 3)]
    assert not any("slowest_exchange_s" in r for r in rounds[:2]) and rounds[2]["iteration"] == 9
    for measured, following in zip(rounds[2:], rounds[3:] + [None]):
        assert measured["slowest_exchange_s"] >= 3 and measured["slowest_step_s"] > 0
        wanted = math.ceil(1.2 * measured["slowest_exchange_s"] / measured["slowest_step_s"])
        assert measured["local_steps"] == min(max(wanted, 2), 6)
        if following is not None:  # the last iteration (18) ends a round too
            assert following["iteration"] == min(measured["iteration"] + measured["local_steps"], 18)
    infos = [json.loads((runs / f"adaptive_h.info.{rank}.json").read_text()) for rank in range(4)]
    assert all(info["hash_checks"] == len(rounds) for info in infos)


def test_pseudo_grad_norm_with_inner_data_parallelism(runs):
    """DP_in = 2 without the distributed optimizer: the logged norm is that of the cluster's whole
    pseudo-gradient, the distance each round moved one replica's full weights (measured from the
    model alone by the writing rank, which holds all of them)."""
    rounds = [r for r in read_jsonl(runs / "dp2.metrics.jsonl") if "outer_step" in r]
    measured = json.loads((runs / "dp2.info.3.json").read_text())["round_norms"]
    assert len(rounds) == len(measured) == ITERS // H
    assert [r["pseudo_grad_norm"] for r in rounds] == pytest.approx(measured, rel=1e-4)


@pytest.mark.parametrize("name", list(NAN_RUNS))
def test_non_finite_round_is_skipped_by_the_whole_model(runs, name):
    """A NaN on one rank of one cluster: every stage and TP rank of every cluster skips the same
    round (base unchanged), the metrics record says so, and nothing crosses between boundaries."""
    skipped = NAN_RUNS[name][1]
    infos = [json.loads((runs / f"{name}.info.{rank}.json").read_text()) for rank in range(4)]
    applied = [not skip for skip in skipped]
    if name == "nan_pp2":
        applied[0] = False  # delay mode: nothing to apply at the first boundary
    for rank, info in enumerate(infos):
        assert [r["skipped"] for r in info["rounds"]] == skipped, rank
        assert [not r["base_kept"] for r in info["rounds"]] == applied, rank
    if name == "nan_pp2":  # delay mode: the whole replica with the NaN restarts from base at once
        assert [info["rounds"][0]["at_base"] for info in infos] == [True, True, False, False]
    rounds = [r for r in read_jsonl(runs / f"{name}.metrics.jsonl") if "outer_step" in r]
    assert [r["skipped"] for r in rounds] == skipped + ([False] if name == "nan_pp2" else [])
    assert all(r["cross_cluster_bytes_between_boundaries"] == 0 for r in rounds)
    assert all(info["final_val_loss"] == info["final_val_loss"] for info in infos[1::2])  # finite at the end
