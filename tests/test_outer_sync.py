"""OuterSync against the single-process reference, in one process (C = 1) and over gloo (C = 2).

The C = 2 scenarios all run in ONE launch of two forked worker processes (process start costs
seconds); the module-scoped fixture collects their results and the tests below check them.
Toy problem: every cluster runs H SGD steps on its own random quadratic
``0.5 * sum(c * (p - target)**2)``; nothing is zero.
"""
import hashlib
import io
import math
import time
import warnings
from dataclasses import asdict

import pytest
import torch

from megatron_dilocox.config import DEFAULT_OVERLAP_STEPS, CompressionConfig, DiLoCoXConfig
from megatron_dilocox.outer.compression import CompressedReducer
from megatron_dilocox.outer.reference import ReferenceDiLoCo, quantized_arrival
from megatron_dilocox.outer.sync import ByteCounter, OuterSync, all_finite, allreduce_mean
from megatron_dilocox.payload import HEADER_BYTES, topk_bytes
from expected_bytes import int8_flush_bytes
from launch import run_forked

MODES = ("sync", "delay", "eager")
SHAPES = [(5, 7), (13,), (3, 4, 2), (129,)]
PAYLOAD = sum(math.prod(s) for s in SHAPES) * 4  # fp32 bytes of one pseudo-gradient
TOPK_PAYLOAD = HEADER_BYTES + topk_bytes(PAYLOAD // 4, 64, 0.1, 2)  # one round of topk_reducer()
H, ROUNDS = 3, 5
SLEEP, COMPUTE = 0.3, 0.6  # overlap scenario: reduction time, local-steps time


def toy_init():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in SHAPES]


def toy_data(cluster):
    g = torch.Generator().manual_seed(100 + cluster)
    targets = [torch.randn(s, generator=g) + cluster for s in SHAPES]
    curvatures = [torch.rand(s, generator=g) + 0.5 for s in SHAPES]
    return targets, curvatures


def local_steps(params, data, steps, lr=0.1):
    for _ in range(steps):
        for p, target, c in zip(params, *data):
            p.sub_(lr * c * (p - target))


def digest(tensors):
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


# Outer Nesterov with momentum (not the plain-SGD default), so the comparisons cover the momentum path.
OUTER = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True)
# Rounds of H from the first and a constant outer lr, as the reference runs them
# (test_local_steps_ramp and test_outer_lr_warmup check the schedules).
FIXED = dict(local_steps_ramp_iters=0, outer_lr_warmup_iters=0)


def config(mode, clusters=2, **kwargs):
    return DiLoCoXConfig(clusters=clusters, local_steps=H, sync_mode=mode, **{**OUTER, **FIXED, **kwargs})


def run_reference(mode, clusters=2, rounds=ROUNDS, landing=None, compress=False, keep_unsent=False,
                  flush=None, steps_out=None):
    """``landing``: the previous round's average is applied this many inner steps into a round;
    ``compress``: every replica compresses with ``topk_reducer()``; ``keep_unsent``: and keeps
    its unsent progress; ``flush``: the residuals are sent at the end, fp32 (32) or int8 (8);
    ``steps_out``: gets each boundary's replica digests."""
    replicas = [toy_init() for _ in range(clusters)]
    compressors = [topk_reducer() for _ in range(clusters)] if compress else None
    arrival = {None: None, 32: lambda residual: residual,
               8: quantized_arrival([math.prod(s) for s in SHAPES], 8, 16)}[flush]
    ref = ReferenceDiLoCo(replicas[0], clusters, mode, OUTER["outer_lr"], OUTER["outer_momentum"], OUTER["nesterov"],
                          compressors, keep_unsent, arrival)
    base_digests = []
    for r in range(rounds):
        steps = H
        if landing and r:
            for k in range(clusters):
                local_steps(replicas[k], toy_data(k), landing)
            ref.land(replicas)
            steps = H - landing
        for k in range(clusters):
            local_steps(replicas[k], toy_data(k), steps)
        ref.step(replicas)
        base_digests.append(digest(ref.base))
        if steps_out is not None:
            steps_out.append([digest(rep) for rep in replicas])
    ref.finish(replicas)
    return replicas, base_digests


# Top-k that drops most of each round (so the residual matters), error feedback on; block 16
# is the final flush's quantization block (several blocks per tensor, the last ones padded).
TOPK = CompressionConfig(codec="topk", bits=2, topk_chunk=64, topk_density=0.1, block=16)


def topk_reducer(counter=None):
    return CompressedReducer(SHAPES, TOPK, counter=counter)


def flush_reducer(counter):
    """The product's final flush: every entry int8, blocks of 16."""
    return CompressedReducer(SHAPES, TOPK.flush_config(), counter=counter)


# -- worker scenarios (run inside each of the two gloo processes) ------------------------------


def scenario_modes(rank, group):
    out = {}
    for mode in MODES:
        params, data = toy_init(), toy_data(rank)
        sync = OuterSync(params, group, config(mode))
        rounds = []
        for r in range(ROUNDS):
            before = sync.counter.bytes
            local_steps(params, data, H)
            mid = sync.counter.bytes
            stats = sync.step((r + 1) * H)
            rounds.append(dict(stats=asdict(stats), before=before, mid=mid,
                               after=sync.counter.bytes, base=digest([sync.base])))
        fin = sync.finish()
        out[mode] = dict(rounds=rounds, finish=fin and asdict(fin), bytes=sync.counter.bytes,
                         calls=sync.counter.calls, drained=sync.state_dict()["pending_grad"] is None,
                         params=[p.clone() for p in params], base=sync.base.clone())
        sync.close()
    return out


LANDING = 1  # inner steps into a round at which the previous round's average is applied


def scenario_landing(rank, group):
    """delay and eager with --dilocox-overlap-steps; eager also checkpointed and resumed between a
    boundary and its landing, and between a landing and the next boundary."""
    out = {}
    for mode in ("delay", "eager"):
        params, data = toy_init(), toy_data(rank)
        sync = OuterSync(params, group, config(mode, overlap_steps=LANDING))
        rounds = []
        for r in range(ROUNDS):
            if r:
                local_steps(params, data, LANDING)
                sync.land()
            local_steps(params, data, H - LANDING if r else H)
            rounds.append(dict(stats=asdict(sync.step((r + 1) * H)), base=digest([sync.base])))
        fin = sync.finish()
        out[mode] = dict(rounds=rounds, finish=fin and asdict(fin), params=[p.clone() for p in params])
        sync.close()
    out["resumed"] = []
    for stop in ("in_flight", "landed"):  # round 2: after its boundary, or after its landing
        params, data = toy_init(), toy_data(rank)
        counter = ByteCounter()
        sync = OuterSync(params, group, config("eager", overlap_steps=LANDING), slow_reducer(counter, 0.1), counter)
        stats = []
        for r in range(ROUNDS):
            if r:
                local_steps(params, data, LANDING)
                sync.land()
                if r == 2 and stop == "landed":
                    sync = _checkpointed(sync, params, group)
            local_steps(params, data, H - LANDING if r else H)
            stats.append(asdict(sync.step((r + 1) * H)))
            if r == 1 and stop == "in_flight":
                sync = _checkpointed(sync, params, group)
        sync.finish()
        sync.close()
        out["resumed"].append(dict(stop=stop, params=params, stats=stats))
    return out


UNSENT_CASES = {"sync": ("sync", None), "delay": ("delay", None), "delay-land": ("delay", LANDING)}
# name: (mode, landing, keep unsent, flush bits: 32 OuterSync's default fp32 mean, 8 the product's)
FLUSH_CASES = {"sync": ("sync", None, False, 8), "delay-land": ("delay", LANDING, False, 8),
               "delay-land-keep-unsent": ("delay", LANDING, True, 8),
               "delay-land-keep-unsent-fp32": ("delay", LANDING, True, 32)}


def scenario_unsent(rank, group, flush=False):
    """--dilocox-keep-unsent with a top-k reducer: base and the replica after every boundary.
    ``flush``: the FLUSH_CASES instead, the residual sent at the end (--dilocox-flush-residual)."""
    out = {}
    cases = FLUSH_CASES if flush else {name: (*case, True, None) for name, case in UNSENT_CASES.items()}
    for name, (mode, landing, keep, bits) in cases.items():
        params, data = toy_init(), toy_data(rank)
        counter = ByteCounter()
        red = topk_reducer(counter)
        landing_flag = {} if mode == "sync" else dict(overlap_steps=landing or H)
        residual = lambda red=red: red.residual  # noqa: E731
        sync = OuterSync(params, group, config(mode, **landing_flag), red, counter,
                         unsent=residual if keep else None, flush=residual if flush else None,
                         flush_reducer=flush_reducer(counter) if bits == 8 else None)
        rounds = []
        for r in range(ROUNDS):
            if landing and r:
                local_steps(params, data, landing)
                sync.land()
            local_steps(params, data, H - landing if landing and r else H)
            sync.step((r + 1) * H)
            rounds.append(dict(base=digest([sync.base]), replica=digest(params)))
        owed = red.residual.clone()
        fin = sync.finish()
        out[name] = dict(rounds=rounds, params=[p.clone() for p in params], owed=owed, residual=red.residual.clone(),
                         finish=fin and asdict(fin))
        sync.close()
    return out


def _checkpointed(sync, params, group):
    """``sync`` saved, closed and restored into a new OuterSync (the params stay in place)."""
    buf = io.BytesIO()
    torch.save(sync.state_dict(), buf)
    sync.close()
    buf.seek(0)
    restored = OuterSync(params, group, sync.config)
    restored.load_state_dict(torch.load(buf))
    return restored


def scenario_nan(rank, group):
    out = {}
    for name, mode, landing in (("sync", "sync", None), ("delay", "delay", None), ("delay-land", "delay", 1)):
        params, data = toy_init(), toy_data(rank)
        sync = OuterSync(params, group, config(mode))
        rounds = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for r in range(4):
                if landing and r:
                    local_steps(params, data, landing)
                    sync.land()  # a skipped average leaves base and the replica's carry alone
                local_steps(params, data, 2 - landing if landing and r else 2)
                if rank == 1 and r == 1:
                    params[1][3] = float("nan")
                stats = sync.step(r)
                rounds.append(dict(skipped=stats.skipped, base=digest([sync.base]),
                                   base_finite=bool(sync.base.isfinite().all()),
                                   params_finite=all(bool(p.isfinite().all()) for p in params)))
            fin = sync.finish()
        out[name] = dict(rounds=rounds, finish_skipped=fin and fin.skipped,
                         warnings=[str(w.message) for w in caught if w.category is RuntimeWarning],
                         params_finite=all(bool(p.isfinite().all()) for p in params))
        sync.close()
    return out


def slow_reducer(counter, seconds):
    def reduce(tensors, group):
        time.sleep(seconds)
        return allreduce_mean(tensors, group, counter)
    return reduce


def scenario_overlap(rank, group):
    out = {}
    for mode, rounds in (("delay", 3), ("sync", 2)):
        counter = ByteCounter()
        params, data = toy_init(), toy_data(rank)
        sync = OuterSync(params, group, config(mode), slow_reducer(counter, SLEEP), counter)
        stats = []
        for r in range(rounds):
            local_steps(params, data, H)
            time.sleep(COMPUTE)  # the H local steps of a real model take longer than the link
            stats.append(asdict(sync.step(r)))
        fin = sync.finish()
        out[mode] = dict(stats=stats, finish=fin and asdict(fin))
        sync.close()
    return out


def scenario_resume(rank, group):
    """delay mode with the outer lr warmed up over the run: uninterrupted, and checkpointed after 2
    rounds with the 2nd reduction in flight (applied after the resume at the lr of its launch),
    resumed and finished."""
    warm = config("delay", outer_lr_warmup_iters=ROUNDS * H)
    params, data = toy_init(), toy_data(rank)
    sync = OuterSync(params, group, warm)
    for r in range(ROUNDS):
        local_steps(params, data, H)
        sync.step((r + 1) * H)
    sync.finish()
    sync.close()
    uninterrupted = params

    counter = ByteCounter()
    params = toy_init()
    sync = OuterSync(params, group, warm, slow_reducer(counter, 0.2), counter)
    for r in range(2):
        local_steps(params, data, H)
        sync.step((r + 1) * H)
    # The slowed reducer counts its call after the sleep: the 2nd round has not even started sending.
    was_inflight = counter.calls == 1
    buf = io.BytesIO()
    torch.save({"outer": sync.state_dict(), "params": params}, buf)
    sync.close()
    buf.seek(0)
    ckpt = torch.load(buf)
    params = [p.clone() for p in ckpt["params"]]
    sync = OuterSync(params, group, warm)
    sync.load_state_dict(ckpt["outer"])
    for r in range(2, ROUNDS):
        local_steps(params, data, H)
        sync.step((r + 1) * H)
    sync.finish()
    sync.close()
    return dict(was_inflight=was_inflight, had_pending=ckpt["outer"]["pending_grad"] is not None,
                params=params, uninterrupted=uninterrupted)


def _scenarios(rank, group):
    return dict(modes=scenario_modes(rank, group), landing=scenario_landing(rank, group), nan=scenario_nan(rank, group),
                overlap=scenario_overlap(rank, group), resume=scenario_resume(rank, group),
                unsent=scenario_unsent(rank, group), flush=scenario_unsent(rank, group, flush=True))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Results of all C = 2 scenarios, one dict per rank."""
    return run_forked(_scenarios, tmp_path_factory.mktemp("outer_sync"), timeout=120)


# -- C = 2 over gloo ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_matches_reference_and_ranks_agree(ranks, mode):
    replicas, ref_digests = run_reference(mode)
    for r in range(ROUNDS):
        digests = [ranks[k]["modes"][mode]["rounds"][r]["base"] for k in range(2)]
        assert digests[0] == digests[1], f"round {r}: base differs across ranks"
        assert digests[0] == ref_digests[r], f"round {r}: base differs from the reference"
    for k in range(2):
        res = ranks[k]["modes"][mode]
        for p, q in zip(res["params"], replicas[k]):
            assert torch.equal(p, q), f"rank {k}: max diff {(p - q).abs().max()}"
        assert torch.equal(res["base"], ranks[0]["modes"][mode]["base"])
        assert torch.equal(res["base"], torch.cat([p.reshape(-1) for p in res["params"]]))
        for r, rnd in enumerate(res["rounds"]):
            s = rnd["stats"]
            assert (s["outer_step"], s["iteration"], s["skipped"]) == (r + 1, (r + 1) * H, False)
            assert s["pseudo_grad_norm"] > 0
            assert s["pseudo_grad_norm"] == pytest.approx(math.sqrt(s["pseudo_grad_sq"]))


@pytest.mark.parametrize("mode", ["delay", "eager"])
def test_landing_matches_reference_and_ranks_agree(ranks, mode):
    replicas, ref_digests = run_reference(mode, landing=LANDING)
    _, at_boundary = run_reference(mode)
    for r in range(ROUNDS):
        assert [ranks[k]["landing"][mode]["rounds"][r]["base"] for k in range(2)] == [ref_digests[r]] * 2
    assert ref_digests[-1] != at_boundary[-1]  # landing early is a different trajectory
    for k in range(2):
        res = ranks[k]["landing"][mode]
        assert all(torch.equal(p, q) for p, q in zip(res["params"], replicas[k]))
        # Each boundary reports the round that landed during it; the last one is drained by finish.
        assert [rnd["stats"]["bytes_sent"] for rnd in res["rounds"]] == [0] + [PAYLOAD] * (ROUNDS - 1)
        assert res["finish"]["bytes_sent"] == PAYLOAD


@pytest.mark.parametrize("name", list(UNSENT_CASES))
def test_keep_unsent_matches_reference(ranks, name):
    """Each replica restarts from base less its own error-feedback residual: the same bits as the
    reference with one compressor per replica, and another trajectory than restarting from base."""
    mode, landing = UNSENT_CASES[name]
    kept, reset = [], []
    replicas, bases = run_reference(mode, landing=landing, compress=True, keep_unsent=True, steps_out=kept)
    _, reset_bases = run_reference(mode, landing=landing, compress=True, steps_out=reset)
    for r in range(ROUNDS):
        assert [ranks[k]["unsent"][name]["rounds"][r]["base"] for k in range(2)] == [bases[r]] * 2, r
        assert [ranks[k]["unsent"][name]["rounds"][r]["replica"] for k in range(2)] == kept[r], r
    assert kept[-1] != reset[-1] and bases[-1] != reset_bases[-1]
    for k in range(2):
        assert all(torch.equal(p, q) for p, q in zip(ranks[k]["unsent"][name]["params"], replicas[k]))


@pytest.mark.parametrize("name", list(FLUSH_CASES))
def test_flush_residual_matches_reference(ranks, name):
    """--dilocox-flush-residual: finish sends both clusters' residuals, every entry (int8 as
    the product does, or fp32), and applies their mean, bit for bit as the reference; the final
    weights then differ from not flushing and (int8) from an fp32 flush, the residual is zero
    afterwards, and that last round's bytes are the drained round's plus the flush's."""
    mode, landing, keep, bits = FLUSH_CASES[name]
    replicas, _ = run_reference(mode, landing=landing, compress=True, keep_unsent=keep, flush=bits)
    unflushed, _ = run_reference(mode, landing=landing, compress=True, keep_unsent=keep)
    fp32, _ = run_reference(mode, landing=landing, compress=True, keep_unsent=keep, flush=32)
    drained = 0 if mode == "sync" else TOPK_PAYLOAD
    flushed = int8_flush_bytes([math.prod(s) for s in SHAPES], 16) if bits == 8 else 4 * sum(math.prod(s) for s in SHAPES)
    for k in range(2):
        res = ranks[k]["flush"][name]
        assert all(torch.equal(p, q) for p, q in zip(res["params"], replicas[k]))
        assert not all(torch.equal(p, q) for p, q in zip(res["params"], unflushed[k]))
        if bits == 8:  # quantized, but only just: within 1/254 of a block's largest entry per entry
            assert not all(torch.equal(p, q) for p, q in zip(res["params"], fp32[k]))
            assert all(torch.allclose(p, q, atol=float(res["owed"].abs().max()) / 254 * OUTER["outer_lr"] * 3)
                       for p, q in zip(res["params"], fp32[k]))
        assert bool((res["owed"] != 0).any()) and not bool(res["residual"].any())
        assert res["finish"]["bytes_sent"] == drained + flushed


def test_landing_resumes_exactly(ranks):
    for rank in ranks:
        straight = rank["landing"]["eager"]
        for res in rank["landing"]["resumed"]:
            assert all(torch.equal(p, q) for p, q in zip(res["params"], straight["params"])), res["stop"]
            # The round exchanged before the stop is not reported again by the resumed run.
            assert [s["bytes_sent"] for s in res["stats"]] == [0, PAYLOAD, 0, PAYLOAD, PAYLOAD]


def test_overlap_steps_needs_an_overlapping_mode_and_a_step():
    with pytest.raises(ValueError, match="--dilocox-overlap-steps needs --dilocox-sync-mode"):
        config("sync", overlap_steps=1).validate()
    with pytest.raises(ValueError, match="--dilocox-overlap-steps must be >= 1"):
        config("eager", overlap_steps=0).validate()
    # When it lands: the flag, else one step into the round; at the boundary without an overlap
    # to land in, and by default with adaptive H (which sizes whole rounds to the exchange).
    assert [config(m).landing for m in MODES] == [None, DEFAULT_OVERLAP_STEPS, DEFAULT_OVERLAP_STEPS]
    assert config("delay", overlap_steps=H).landing == H
    assert config("delay", max_local_steps=2 * H).landing is None
    assert config("delay", max_local_steps=2 * H, overlap_steps=2).landing == 2


def test_modes_differ(ranks):
    finals = [torch.cat([p.reshape(-1) for p in ranks[0]["modes"][m]["params"]]) for m in MODES]
    assert all(not torch.equal(a, b) for i, a in enumerate(finals) for b in finals[i + 1:])


def test_sync_bytes_only_at_boundaries(ranks):
    for res in (rank["modes"]["sync"] for rank in ranks):
        for r, rnd in enumerate(res["rounds"]):
            assert rnd["mid"] == rnd["before"] == r * PAYLOAD  # nothing between boundaries
            assert rnd["after"] == (r + 1) * PAYLOAD
            assert rnd["stats"]["bytes_sent"] == PAYLOAD
        assert res["finish"] is None and res["drained"]
        assert (res["bytes"], res["calls"]) == (ROUNDS * PAYLOAD, ROUNDS)  # one allreduce a round


@pytest.mark.parametrize("mode", ["delay", "eager"])
def test_delay_bytes_one_payload_per_round_and_finish_drains(ranks, mode):
    for res in (rank["modes"][mode] for rank in ranks):
        for r, rnd in enumerate(res["rounds"]):
            # r reductions launched before boundary r; at least r - 1 of them done
            assert rnd["before"] in (max(r - 1, 0) * PAYLOAD, r * PAYLOAD)
            assert rnd["mid"] in (max(r - 1, 0) * PAYLOAD, r * PAYLOAD)
            assert rnd["after"] in (r * PAYLOAD, (r + 1) * PAYLOAD)
            assert rnd["stats"]["bytes_sent"] == (PAYLOAD if r else 0)
        assert res["finish"]["bytes_sent"] == PAYLOAD and not res["finish"]["skipped"]
        assert res["drained"]
        assert (res["bytes"], res["calls"]) == (ROUNDS * PAYLOAD, ROUNDS)


@pytest.mark.parametrize("mode,skipped_round", [("sync", 1), ("delay", 2), ("delay-land", 2)])
def test_non_finite_round_is_skipped_everywhere(ranks, mode, skipped_round):
    # rank 1 puts a NaN in its params before boundary 1; delay mode learns of it one round later
    # (landing mid-round: when it lands, reported at the next boundary)
    results = [rank["nan"][mode] for rank in ranks]
    for k, res in enumerate(results):
        assert [rnd["skipped"] for rnd in res["rounds"]] == [r == skipped_round for r in range(4)]
        assert all(rnd["base_finite"] and rnd["params_finite"] for rnd in res["rounds"])
        assert res["params_finite"] and not res["finish_skipped"]
        assert any("skipping the outer update" in w for w in res["warnings"])
        local_warning = any("local pseudo-gradient is non-finite" in w for w in res["warnings"])
        assert local_warning == (mode != "sync" and k == 1)
    for a, b in zip(results[0]["rounds"], results[1]["rounds"]):
        assert a["base"] == b["base"]


def test_delay_overlaps_reduction_with_local_steps(ranks):
    for rank in ranks:
        delay, sync = rank["overlap"]["delay"]["stats"], rank["overlap"]["sync"]["stats"]
        assert delay[0]["wait_s"] == 0 and delay[0]["comm_s"] == 0  # nothing in flight yet
        for s in delay[1:]:
            assert s["comm_s"] >= 0.95 * SLEEP
            assert s["wait_s"] < 0.5 * s["comm_s"]
            assert s["bytes_sent"] == PAYLOAD
        for s in sync:
            assert s["comm_s"] >= 0.95 * SLEEP
            assert s["wait_s"] >= 0.8 * SLEEP
            assert s["bytes_sent"] == PAYLOAD


def test_resume_with_round_in_flight_matches_uninterrupted(ranks):
    for rank in ranks:
        res = rank["resume"]
        assert res["was_inflight"] and res["had_pending"]
        for p, q in zip(res["params"], res["uninterrupted"]):
            assert torch.equal(p, q)


# -- single process (C = 1, group None) --------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_single_cluster_matches_reference(mode):
    (replica,), _ = run_reference(mode, clusters=1)
    params = toy_init()
    sync = OuterSync(params, None, config(mode, clusters=1))
    for r in range(ROUNDS):
        local_steps(params, toy_data(0), H)
        assert sync.step(r).bytes_sent == 0
    sync.finish()
    sync.close()
    assert all(torch.equal(p, q) for p, q in zip(params, replica))
    assert sync.counter.bytes == 0


def test_worker_gets_a_private_delta():
    params = toy_init()
    seen = []

    def reducer(tensors, group):
        seen.append(tensors[0].data_ptr())
        return tensors

    sync = OuterSync(params, None, config("delay", clusters=1), reducer=reducer)
    for r in range(3):
        local_steps(params, toy_data(0), H)
        sync.step(r)
    sync.finish()
    sync.close()
    owned = {p.data_ptr() for p in params} | {sync.base.data_ptr(), sync.round_start.data_ptr()}
    assert len(seen) == 3 and not owned & set(seen)


@pytest.mark.parametrize("mode", ["sync", "delay"])
def test_finish_counts_the_flush_as_time_training_waited(mode):
    """The flush runs on the training thread after the last round: the drain's wait_s holds it
    (a benchmark adds the drain's wait to the training time)."""
    params = toy_init()
    residual = [torch.ones(sum(math.prod(s) for s in SHAPES))]
    sync = OuterSync(params, None, config(mode, clusters=1), unsent=lambda: residual[0],
                     flush=lambda: residual[0], flush_reducer=slow_reducer(ByteCounter(), 0.3))
    local_steps(params, toy_data(0), H)
    sync.step(H)
    stats = sync.finish()
    sync.close()
    assert stats.wait_s >= 0.3 and stats.comm_s >= 0.3
    assert not residual[0].any()  # sent


@pytest.mark.parametrize("mode", ["sync", "delay"])
def test_each_reduction_gets_the_lr_scale_of_its_launch(mode):
    """A reduction runs while the next round trains, so its lr_scale is the one given at the
    boundary that launched it; none is handed over when none is given."""
    params = toy_init()
    seen = []

    def reducer(tensors, group, **round_args):
        seen.append(round_args.get("lr_scale"))
        return tensors

    sync = OuterSync(params, None, config(mode, clusters=1), reducer=reducer)
    for r, scale in enumerate([1.0, 0.5, None, 0.25]):
        local_steps(params, toy_data(0), H)
        sync.step(r, lr_scale=scale)
    sync.finish()
    sync.close()
    assert seen == [1.0, 0.5, None, 0.25]


def test_drained_base_previews_finish_without_changing_state():
    params = toy_init()
    sync = OuterSync(params, None, config("delay", clusters=1))
    for r in range(3):  # momentum buffers exist and a round is in flight
        local_steps(params, toy_data(0), H)
        sync.step(r)
    before = digest([sync.base, sync.round_start, *sync.optimizer.momentum_buffers, *params])
    preview = sync.drained_base().clone()
    assert digest([sync.base, sync.round_start, *sync.optimizer.momentum_buffers, *params]) == before
    assert not torch.equal(preview, sync.base)
    assert sync.finish() is not None  # the round is still in flight
    sync.close()
    assert torch.equal(preview, sync.base)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offloading moves the outer state off a GPU")
@pytest.mark.parametrize("mode", MODES)
def test_offloaded_outer_state_lives_in_pinned_host_memory_and_changes_nothing(mode):
    results = []
    for offload in (False, True):
        params = [p.cuda() for p in toy_init()]
        sync = OuterSync(params, None, config(mode, clusters=1, offload_outer_state=offload))
        for r in range(ROUNDS):
            local_steps(params, [[t.cuda() for t in part] for part in toy_data(0)], H)
            sync.step(r)
        assert sync.base.is_cuda != offload and sync.base.is_pinned() == offload
        sync.finish()
        sync.close()
        results.append([p.cpu() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_timeout_names_the_flag():
    params = toy_init()
    sync = OuterSync(params, None, config("sync", clusters=1, outer_timeout_s=0.1),
                     reducer=slow_reducer(ByteCounter(), 0.5))
    local_steps(params, toy_data(0), H)
    with pytest.raises(TimeoutError, match="--dilocox-outer-timeout-s"):
        sync.step(H)
    sync.close()


def test_rejects_bad_setup():
    with pytest.raises(ValueError, match="outer group has 1 ranks"):
        OuterSync(toy_init(), None, config("delay", clusters=2))
    with pytest.raises(ValueError, match="fp32"):
        OuterSync([t.bfloat16() for t in toy_init()], None, config("delay", clusters=1))
    with pytest.raises(ValueError, match="--dilocox-local-steps"):
        OuterSync(toy_init(), None, DiLoCoXConfig(clusters=1, local_steps=0))
    state = OuterSync(toy_init(), None, config("delay", clusters=1)).state_dict()
    with pytest.raises(ValueError, match="same mode"):
        OuterSync(toy_init(), None, config("sync", clusters=1)).load_state_dict(state)


def test_all_finite_matches_isfinite():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3)) * 1e-3
    assert all_finite(x) and all_finite(x[:0])
    for bad in ([float("nan")], [float("inf")], [float("-inf")], [float("inf"), float("-inf")]):
        y = x.clone()
        y[7: 7 + len(bad)] = torch.tensor(bad)
        assert not all_finite(y) and not bool(torch.isfinite(y).all()), bad


@pytest.mark.parametrize("mode", ["sync", "delay"])
def test_agreed_finiteness_decides_the_skip(mode):
    """The ``agree`` hook's answer, not this rank's own finite shard, decides: another rank of the
    model reporting a NaN makes this one skip the round and restart from base too."""
    asked = []

    def others_saw_nan(flags):
        asked.append(list(flags))
        return [False] * len(flags)

    params = toy_init()
    sync = OuterSync(params, None, config(mode, clusters=1), agree=others_saw_nan)
    start = sync.base.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for r in range(2):
            local_steps(params, toy_data(0), 2)
            stats = sync.step(r)
        fin = sync.finish()
    assert asked[0] == [True, True]  # this rank's own answers: all finite
    assert stats.skipped and (fin is None) == (mode == "sync") and (fin is None or fin.skipped)
    assert torch.equal(sync.base, start)  # nothing applied
    assert all(torch.equal(p, v) for p, v in zip(params, sync.views(sync.base)))
    assert any("skipping the outer update" in str(w.message) for w in caught)
    sync.close()


def test_outer_lr_warmup():
    """The outer lr of a round grows linearly with the iteration that ends it, from 1 (the plain
    average) at iteration 0 to --dilocox-outer-lr from the warm-up's end on, up or down."""
    up = DiLoCoXConfig(outer_lr=1.4, outer_lr_warmup_iters=600)
    assert [up.outer_lr_at(i) for i in (0, 150, 300, 600, 9000)] == pytest.approx([1.0, 1.1, 1.2, 1.4, 1.4])
    assert up.outer_lr_at(599) < 1.4
    down = DiLoCoXConfig(outer_lr=0.6, outer_lr_warmup_iters=100)
    assert [down.outer_lr_at(i) for i in (0, 50, 100)] == pytest.approx([1.0, 0.8, 0.6])
    assert [DiLoCoXConfig(outer_lr=1.4, outer_lr_warmup_iters=0).outer_lr_at(i) for i in (0, 7)] == [1.4, 1.4]
    with pytest.raises(ValueError, match="--dilocox-outer-lr-warmup-iters must be >= 0"):
        DiLoCoXConfig(outer_lr_warmup_iters=-1).validate()


def test_local_steps_ramp():
    """H grows from 1 by one step every N / H iterations and stays at H from iteration N on; the
    rounds it adds over a run follow the harmonic sum in the flag's help."""
    ramp = DiLoCoXConfig(local_steps=10, local_steps_ramp_iters=300)
    assert [ramp.local_steps_at(i) for i in (0, 29, 30, 59, 60, 269, 270, 299, 300, 5000)] == [1, 1, 2, 2, 3, 9, 10, 10, 10, 10]
    assert [DiLoCoXConfig(local_steps=10, local_steps_ramp_iters=0).local_steps_at(i) for i in (0, 7)] == [10, 10]
    boundary, rounds = 0, 0
    while boundary < 1400:
        boundary, rounds = boundary + ramp.local_steps_at(boundary), rounds + 1
    assert rounds - 140 == 59 and abs(59 - 300 / 10 * sum(1 / h for h in range(2, 11))) < 2


def test_a_joiner_applies_the_round_at_its_peers_outer_lr():
    """A restarted replica joins within a round its live peer launched: it takes the peer's global
    parameters and outer state and applies that round as the peer does, with the outer lr of the
    peer's iteration under the warm-up (not of its own), ending bit-identical to the peer."""
    cfg = config("sync", clusters=1, outer_lr=1.6, outer_lr_warmup_iters=5 * H)
    served, reduced = {}, []

    def peer_reducer(tensors, group):
        if len(reduced) == 2:  # the peer's third round, in flight: what it serves to a joiner
            served.update(peer.serve())
        reduced.append(tensors[0].clone())
        return tensors

    data = toy_data(0)
    peer = OuterSync(toy_init(), None, cfg, peer_reducer)
    for r in range(3):
        local_steps(peer.params, data, H)
        peer.step((r + 1) * H)

    def joiner_reducer(tensors, group):
        joiner.join(served)
        return [reduced[2].clone()]  # the round's average, as the peer reduced it

    joiner = OuterSync(toy_init(), None, cfg, joiner_reducer)
    local_steps(joiner.params, toy_data(1), H)
    joiner.step(H)  # its own first boundary, while the peer is at its third
    assert joiner.joined_at == 3 * H and joiner.outer_step == peer.outer_step
    assert torch.equal(joiner.base, peer.base)
    assert all(torch.equal(p, q) for p, q in zip(joiner.params, peer.params))
    joiner.close()
    peer.close()

