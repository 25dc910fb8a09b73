"""Checkpoints: exact resume (vanilla, DiLoCoX sync and delay with compression), resharding,
bad input (tampered, truncated, missing, unlisted, edited manifest, incompatible, killed
mid-save), one run per save directory, first launch with --save X --load X, retention."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from launch import REPO, free_port, read_jsonl, torchrun, worker_env
from megatron_dilocox.checkpoint import files
from megatron_dilocox.payload import HANDSHAKE_BYTES

ITERS = 8
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "3e-3",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
         "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "1"]  # dropout on: RNG must resume too
VANILLA = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
# Rounds of H from the start (the "ramp" run below ramps them); the outer lr's default warm-up is on.
DILOCOX = ["--pipeline-model-parallel-size", "2", "--dilocox", "--dilocox-clusters", "2", "--dilocox-local-steps", "2",
           "--dilocox-local-steps-ramp-iters", "0",
           "--dilocox-compression", "lowrank-quantize", "--dilocox-rank", "4", "--dilocox-error-feedback"]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--num-query-groups", "2"]
# name: (flags, iteration to stop at). Delay stops mid-round, with a reduction in flight.
RESUMED = {"vanilla": (VANILLA, 4),
           "delay": (DILOCOX + ["--dilocox-sync-mode", "delay", "--dilocox-overlap-steps", "2"], 5),  # lands at boundaries
           "sync": (DILOCOX + ["--dilocox-sync-mode", "sync"], 4),
           # H = 4, the average lands 2 steps into a round: stops with round 1 in flight, not landed.
           "landing": (DILOCOX + ["--dilocox-sync-mode", "eager", "--dilocox-local-steps", "4",
                                  "--dilocox-overlap-steps", "2"], 5),
           # H ramped over 4 iterations: boundaries after iterations 1, 2, 4, 6, 8; stops with round 3 in flight.
           "ramp": (DILOCOX + ["--dilocox-sync-mode", "delay", "--dilocox-local-steps-ramp-iters", "4"], 3)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    # The launch scripts' first launch: --load on the (existing, empty) directory it saves to.
    (out / "vanilla_final").mkdir()
    first_launch = {"vanilla": ["--load", str(out / "vanilla_final")]}
    specs = []
    for name, (flags, stop) in RESUMED.items():
        stopped = ["--save", str(out / f"{name}_stop"), "--exit-interval", str(stop)]
        straight = ["--save", str(out / f"{name}_final")] + first_launch.get(name, [])
        specs += [{"name": f"{name}_straight", "flags": MODEL + flags + straight},
                  {"name": f"{name}_stopped", "flags": MODEL + flags + stopped},
                  {"name": f"{name}_resumed", "flags": MODEL + flags + ["--load", str(out / f"{name}_stop")]}]
    # Resharding, with nothing left to train (evaluate the loaded weights): vanilla TP2/PP2 -> TP1/PP4,
    # and the DiLoCoX run stopped with a round in flight -> vanilla TP2/PP2 (weights only) vs. an
    # exact resume of it (which drains the round).
    # (The exact resume does not flush the residual at its end: the saved weights do not hold it.)
    five = ["--train-iters", "5", "--load", str(out / "delay_stop")]
    specs += [{"name": "vanilla_pp4", "flags": MODEL + ["--pipeline-model-parallel-size", "4",
                                                        "--load", str(out / "vanilla_final")]},
              {"name": "delay_at5_exact",
               "flags": MODEL + RESUMED["delay"][0] + five + ["--no-dilocox-flush-residual"]},
              {"name": "delay_at5_tp2_vanilla", "flags": MODEL + VANILLA + five},
              # DiLoCoX on from the stopped run in another layout (PP1, DP2 per cluster): weights only,
              # a fresh outer state whose rounds run from iteration 5 on.
              {"name": "delay_from5_pp1", "flags": MODEL + RESUMED["delay"][0][2:] + ["--load", str(out / "delay_stop")]},
              {"name": "llama_straight", "flags": MODEL + LLAMA + VANILLA + ["--save", str(out / "llama_final")]}]
    (out / "spec.json").write_text(json.dumps(specs))
    proc = torchrun(4, REPO / "tests" / "scenarios.py", [str(out), str(out / "spec.json")], timeout=900)
    (out / "torchrun.log").write_text(proc.stdout + proc.stderr)
    return out


def _metrics(out, name):
    records = read_jsonl(out / f"{name}.metrics.jsonl")
    return ({r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r},
            [r["val_loss"] for r in records if "val_loss" in r])


def _params(out, name):
    merged = {}
    for rank in range(4):
        path = out / f"{name}.params.{rank}.pt"
        if path.exists():
            merged.update(torch.load(path))
    return merged


def _info(out, name, rank=3):
    return json.loads((out / f"{name}.info.{rank}.json").read_text())


@pytest.mark.parametrize("name", list(RESUMED))
def test_resume_is_bitwise_exact(runs, name):
    straight_loss, straight_val = _metrics(runs, f"{name}_straight")
    stopped_loss, _ = _metrics(runs, f"{name}_stopped")
    resumed_loss, resumed_val = _metrics(runs, f"{name}_resumed")
    stop = RESUMED[name][1]
    assert sorted(stopped_loss) == list(range(1, stop + 1))
    assert sorted(resumed_loss) == list(range(stop + 1, ITERS + 1))
    assert {**stopped_loss, **resumed_loss} == straight_loss  # float equality: bitwise
    assert resumed_val[-1] == straight_val[-1]
    # The cross-cluster byte count goes on from the checkpoint's; the codec's handshake is sent
    # again after a resume.
    totals = [[r["cross_cluster_bytes"] for r in read_jsonl(runs / f"{name}_{part}.metrics.jsonl")
               if r.get("cross_cluster_bytes") is not None][-1:] for part in ("straight", "resumed")]
    assert totals[1] == [totals[0][0] + HANDSHAKE_BYTES] if name != "vanilla" else totals == [[], []], totals
    assert _info(runs, f"{name}_resumed")["start_iteration"] == stop
    straight, resumed = _params(runs, f"{name}_straight"), _params(runs, f"{name}_resumed")
    assert set(straight) == set(resumed) and len(straight) > 10
    different = [n for n in straight if not torch.equal(straight[n], resumed[n])]
    assert not different, f"parameters differ after resuming: {different[:5]}"


def test_dilocox_rounds_go_on_after_a_weights_only_resume(runs):
    # The fresh outer state's first round ends H = 2 steps after the loaded iteration 5 (it ended
    # at H counted from 0, before 5, and no round ever came: a silent switch to local training);
    # the last iteration ends a short round of its own.
    rounds = [r for r in read_jsonl(runs / "delay_from5_pp1.metrics.jsonl") if "outer_step" in r]
    assert [(r["outer_step"], r["iteration"]) for r in rounds if not r["drain"]] == [(1, 7), (2, ITERS)]
    assert rounds[-1]["drain"] and rounds[-1]["bytes_sent"] > 0  # its average, in flight at the end, applied then
    assert _info(runs, "delay_from5_pp1")["start_iteration"] == 5


def test_first_launch_with_load_on_an_empty_directory_starts_from_scratch(runs):
    log = (runs / "torchrun.log").read_text()
    warning = f"WARNING: --load {runs / 'vanilla_final'}: no checkpoint there yet"
    assert log.count(warning) == 1, log[-3000:]  # once, not once per rank
    assert _info(runs, "vanilla_straight")["start_iteration"] == 0
    assert (runs / "vanilla_final" / files.TRACKER).read_text().strip() == str(ITERS)
    assert not (runs / "vanilla_final" / files.LOCK).exists()  # released at exit


def test_checkpoint_layout_and_manifest(runs):
    root = runs / "delay_stop"
    assert (root / files.TRACKER).read_text().strip() == "5"
    folder = root / "iter_0000005"
    manifest = files.read_manifest(folder)
    assert manifest["iteration"] == 5 and manifest["dilocox"]["outer_step"] == 2
    ranks = sorted(n for n in manifest["files"] if n.startswith("ranks/"))
    assert ranks == [f"ranks/c{c:02d}_tp00_pp{p:03d}_dp000.pt" for c in range(2) for p in range(2)]
    assert any(n.startswith("model/") for n in manifest["files"])
    files.verify(folder, manifest, manifest["files"])
    state = torch.load(folder / ranks[0], weights_only=True)
    sync = state["dilocox"]["sync"]
    assert sync["pending_grad"] is not None  # the round in flight was saved, not lost
    assert state["dilocox"]["compressor"]["residual"] is not None
    assert not list(root.glob("*.partial"))


def test_resharded_weights_give_the_same_validation_loss(runs):
    # Vanilla: saved on TP2/PP2 at the end (before the final evaluation), loaded on TP1/PP4.
    _, saved_val = _metrics(runs, "vanilla_straight")
    _, loaded_val = _metrics(runs, "vanilla_pp4")
    assert loaded_val[-1] == pytest.approx(saved_val[-1], rel=1e-5)
    # DiLoCoX stopped with a round in flight: its global weights (the round applied) evaluated
    # by an exact resume that drains, and by a vanilla TP2/PP2 run that loads only the weights.
    _, exact_val = _metrics(runs, "delay_at5_exact")
    _, weights_val = _metrics(runs, "delay_at5_tp2_vanilla")
    assert weights_val[-1] == pytest.approx(exact_val[-1], rel=1e-5)
    assert _info(runs, "delay_at5_tp2_vanilla")["start_iteration"] == 5


def _kill_mid_save(root):
    """Runs a 1-rank job that saves every iteration and SIGKILLs it while a save is half-written."""
    cmd = [sys.executable, "pretrain_gpt.py", *MODEL, "--train-iters", "200", "--save", str(root), "--save-interval", "1"]
    env = worker_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if (root / files.TRACKER).exists() and list(root.glob("*.partial/model/*")):
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.002)
        else:
            pytest.fail("the job never started a second save")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert list(root.glob("*.partial")), "killed outside a save"


def _corrupt(src, dst, how):
    shutil.copytree(src, dst)
    folder = files.latest(dst)
    manifest = files.read_manifest(folder)
    rank_file = folder / next(n for n in manifest["files"] if n.startswith("ranks/"))
    if how == "flip":
        data = bytearray(rank_file.read_bytes())
        data[len(data) // 2] ^= 0x01
        rank_file.write_bytes(bytes(data))
    elif how == "truncate":
        model_file = max((folder / n for n in manifest["files"] if n.startswith("model/")), key=os.path.getsize)
        model_file.write_bytes(model_file.read_bytes()[:-100])
    elif how == "no_manifest":
        (folder / files.MANIFEST).unlink()
    elif how == "dangling_tracker":
        (dst / files.TRACKER).write_text("123\n")
    elif how == "missing":
        rank_file.unlink()
    elif how == "unlisted":  # e.g. another run's shard, written into this checkpoint
        (folder / "model" / "__9_9.distcp").write_bytes(b"\0" * 64)
    elif how == "edited_manifest":
        path = folder / files.MANIFEST
        path.write_text(path.read_text().replace('"iteration": 4', '"iteration": 104'))


BAD = {
    "flip": r"ranks/c00_tp00_pp000_dp000\.pt: sha256 differs from the manifest",
    "truncate": r"model/.*: \d+ bytes, the manifest says \d+ \(truncated\?\)",
    "no_manifest": r"iter_0000004/manifest\.json: missing \(incomplete checkpoint\)",
    "dangling_tracker": r"latest_checkpointed_iteration\.txt points at iteration 123 but .*iter_0000123 does not exist",
    "missing": r"ranks/c00_tp00_pp000_dp000\.pt: missing \(listed in the manifest\)",
    "unlisted": r"iter_0000004/model/__9_9\.distcp: not listed in the manifest",
    "edited_manifest": r"iter_0000004/manifest\.json: sha256 differs from manifest\.json\.sha256 \(edited",
}


def _lock(root, pid):
    """A lock of ``root`` held by process ``pid`` of this host."""
    root.mkdir()
    (root / files.LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "started": "earlier"}))


def test_bad_checkpoints_fail_clearly_and_a_killed_save_keeps_the_last_one(runs, tmp_path):
    killed = tmp_path / "killed"
    _kill_mid_save(killed)
    good = runs / "vanilla_stop"
    specs = []
    for how in BAD:
        _corrupt(good, tmp_path / how, how)
        specs.append({"name": how, "flags": MODEL + ["--load", str(tmp_path / how)], "expect_error": True})
    specs.append({"name": "wider", "expect_error": True,
                  "flags": MODEL + ["--hidden-size", "128", "--load", str(good)]})
    last = int((killed / files.TRACKER).read_text())
    specs.append({"name": "killed", "flags": MODEL + ["--train-iters", "200", "--load", str(killed),
                                                      "--exit-interval", str(last + 1)]})
    # A save directory in use by a live run (this test's process) is refused; one whose run is
    # gone is taken over, and with --most-recent-k 2 only the last two saves stay.
    _lock(tmp_path / "in_use", os.getpid())
    specs.append({"name": "in_use", "expect_error": True, "flags": MODEL + ["--save", str(tmp_path / "in_use")]})
    gone = subprocess.Popen(["true"])
    gone.wait()
    _lock(tmp_path / "retained", gone.pid)
    specs.append({"name": "retained", "flags": MODEL + ["--train-iters", "4", "--save", str(tmp_path / "retained"),
                                                        "--save-interval", "1", "--most-recent-k", "2"]})
    (tmp_path / "spec.json").write_text(json.dumps(specs))
    proc = torchrun(1, REPO / "tests" / "scenarios.py", [str(tmp_path), str(tmp_path / "spec.json")])
    in_use = (tmp_path / "in_use.error.0.txt").read_text()
    assert re.fullmatch(rf".*in_use/run\.lock: --save directory in use by another run \(host {socket.gethostname()}, "
                        rf"pid {os.getpid()}, started earlier\);[^\n]*", in_use), in_use
    assert (proc.stdout + proc.stderr).count(f"took over the lock of a run that is gone (host {socket.gethostname()}, "
                                             f"pid {gone.pid}") == 1
    retained = tmp_path / "retained"
    assert sorted(p.name for p in retained.iterdir()) == ["iter_0000003", "iter_0000004", files.TRACKER]
    assert files.read_manifest(retained / "iter_0000003")["iteration"] == 3
    for how, pattern in BAD.items():
        message = (tmp_path / f"{how}.error.0.txt").read_text()
        assert re.search(pattern, message), (how, message)
        assert "\n" not in message
    wider = (tmp_path / "wider.error.0.txt").read_text()
    assert "manifest.json: model mismatch: --hidden-size is 64 in the checkpoint, 128 in this run" in wider
    # The killed job's last complete checkpoint resumes (and its half-written successor is ignored).
    assert last >= 1 and _info(tmp_path, "killed", rank=0)["start_iteration"] == last
    assert _metrics(tmp_path, "killed")[0].keys() == {last + 1}


def _tool(*argv):
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=worker_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout


def _hf_params(folder):
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_dilocox.checkpoint import hf

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model, hf.from_hf(model, AutoConfig.from_pretrained(folder))[0]


FAMILIES = {"vanilla": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}


@pytest.fixture(scope="module")
def converted(runs):
    """Each family's final checkpoint exported to Hugging Face (with the tool's logits check) and
    imported back as a weights-only checkpoint: {name: (hf folder, to-hf output, our folder)}."""
    result = {}
    for name in FAMILIES:
        exported, ours = runs / f"{name}_hf", runs / f"{name}_from_hf"
        printed = _tool("tools/checkpoint/convert.py", "to-hf", "--load", str(runs / f"{name}_final"),
                        "--save", str(exported), "--check-logits")
        imported = _tool("tools/checkpoint/convert.py", "from-hf", "--load", str(exported), "--save", str(ours))
        assert f"--load {ours}" in imported
        result[name] = (exported, printed, ours)
    return result


@pytest.mark.parametrize("name", list(FAMILIES))
def test_export_loads_in_transformers_with_our_logits_and_weights(runs, converted, name):
    exported, printed, _ = converted[name]
    diff = float(re.search(r"max abs difference (\S+)", printed).group(1))
    assert diff < 1e-4, printed
    model, params = _hf_params(exported)
    assert type(model).__name__ == FAMILIES[name]
    trained = _params(runs, f"{name}_straight")  # the weights the run ended with, which it saved
    assert set(params) == set(trained)
    assert all(torch.equal(params[n], trained[n]) for n in trained)


def test_import_round_trips_bit_for_bit(converted, tmp_path):
    exported, _, ours = converted["llama"]
    report = json.loads(_tool("tools/checkpoint/inspect.py", str(ours), "--json"))
    assert report["kind"] == "weights" and report["layout"] is None
    assert all(f["status"] == "OK" for f in report["files"].values())
    _tool("tools/checkpoint/convert.py", "to-hf", "--load", str(ours), "--save", str(tmp_path / "again"))
    _, before = _hf_params(exported)
    _, after = _hf_params(tmp_path / "again")
    assert set(before) == set(after) and all(torch.equal(after[n], before[n]) for n in before)


def test_imported_model_trains_on_in_another_layout(runs, converted, tmp_path):
    ours = converted["llama"][2]
    spec = [{"name": "trains_on", "flags": MODEL + LLAMA + ["--pipeline-model-parallel-size", "2", "--load", str(ours)]}]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    torchrun(2, REPO / "tests" / "scenarios.py", [str(tmp_path), str(tmp_path / "spec.json")])
    losses, _ = _metrics(tmp_path, "trains_on")
    straight, _ = _metrics(runs, "llama_straight")
    assert sorted(losses) == list(range(1, ITERS + 1))  # a converted checkpoint starts at iteration 0
    # It starts from the trained weights (the original run's first step started from the init) and learns.
    assert losses[1] < straight[1] - 0.1
    assert losses[ITERS] < losses[1]


def test_inspect_reports_a_tampered_file(runs, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(runs / "delay_stop", copy)
    report = json.loads(_tool("tools/checkpoint/inspect.py", str(copy), "--json"))
    assert report["outer_state"]["round_in_flight"] is True
    assert report["dilocox"]["sync_mode"] == "delay"
    victim = copy / "iter_0000005" / "ranks" / "c01_tp00_pp001_dp000.pt"
    victim.write_bytes(victim.read_bytes()[:-1] + b"x")
    (copy / "iter_0000005" / "model" / "__7_0.distcp").write_bytes(b"another run's")
    proc = subprocess.run([sys.executable, "tools/checkpoint/inspect.py", str(copy)], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert "FAILED" in proc.stdout and "c01_tp00_pp001_dp000.pt: sha256 differs" in proc.stdout
    assert "model/__7_0.distcp: not listed in the manifest" in proc.stdout
    manifest = copy / "iter_0000005" / files.MANIFEST
    manifest.write_text(manifest.read_text().replace('"iteration": 5', '"iteration": 6'))
    proc = subprocess.run([sys.executable, "tools/checkpoint/inspect.py", str(copy)], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == [f"inspect.py: error: {manifest}: sha256 differs from manifest.json.sha256 (edited or corrupted)"]
