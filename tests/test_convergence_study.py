"""tools/convergence_study.py: flag checks, run order and resume, the summary's figures, and one
tiny study end to end (two real runs, then a resume that runs nothing)."""

import json
import os
import statistics
import subprocess
import sys

import pytest

from launch import REPO, worker_env

sys.path.insert(0, str(REPO / "tools"))

import convergence_study as cs  # noqa: E402
from megatron_dilocox.payload import HANDSHAKE_BYTES  # noqa: E402

PRETRAIN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
            "--train-iters", "12", "--lr", "3e-3", "--split", "80,20,0", "--dilocox-clusters", "2",
            "--log-interval", "4", "--eval-interval", "6"]


def _data(ds, tmp_path) -> list[str]:
    return ["--data-path", str(ds / "c_text_document"), "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", str(ds / "sp.model"), "--data-cache-path", str(tmp_path / "cache")]


@pytest.mark.parametrize("argv, message", [
    (["--out", "o", "--method", "A=", "--baseline", "A"], "flags after --"),
    (["--out", "o", "--baseline", "A", "--", *PRETRAIN], "at least one --method"),
    (["--out", "o", "--method", "A", "--baseline", "A", "--", *PRETRAIN], "NAME=FLAGS"),
    (["--out", "o", "--method", "A=", "--method", "A=--lr 1", "--baseline", "A", "--", *PRETRAIN], "given twice"),
    (["--out", "o", "--method", "A=", "--", *PRETRAIN], "at least one --baseline"),
    (["--out", "o", "--method", "A=", "--baseline", "B", "--", *PRETRAIN], "'B' is not a --method"),
    (["--out", "o", "--method", "A=--seed 3", "--baseline", "A", "--", *PRETRAIN], "--seed is set by the study"),
    (["--out", "o", "--method", "A=", "--baseline", "A", "--seeds", "1,1", "--", *PRETRAIN], "distinct integers"),
    (["--out", "o", "--method", "A=", "--baseline", "A", "--", *PRETRAIN[:14], *PRETRAIN[16:]],
     "must contain --train-iters"),
])
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        cs.main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err, err


def _study(tmp_path, methods, baselines, seeds=(1, 2, 3), compare=None):
    argv = ["--out", str(tmp_path / "s"), "--seeds", ",".join(map(str, seeds))]
    for name, flags in methods.items():
        argv += ["--method", f"{name}={flags}"]
    for name in baselines:
        argv += ["--baseline", name]
    if compare:
        argv += ["--compare", compare]
    parser = cs.build_parser()
    args = parser.parse_args([*argv, "--", *PRETRAIN, "--mock-data", "--tokenizer-type", "NullTokenizer",
                              "--vocab-size", "64"])
    cfg = cs.check_args(parser, args)
    cfg["facts"] = {"train_tokens": 6144, "train_iters": 12}
    return cs.Study(args, cfg)


def _finish(study, method, seed, loss, nbytes=1000):
    """Writes the done.json a finished run leaves (a summary with made-up figures)."""
    folder = study.folder(method, seed)
    folder.mkdir(parents=True, exist_ok=True)
    summary = dict(method=method, seed=seed, flags=study.flags(method, seed), nproc=study.args.nproc,
                   settings=study.settings(method, seed),
                   val_loss=loss, val_loss_se=0.01, cross_cluster_bytes=nbytes, bytes_per_round=None,
                   dense_bytes_per_round=None, rounds=0, train_s=1.0, curve=[])
    (folder / "done.json").write_text(json.dumps(summary))


def test_run_order_best_baseline_and_resume(tmp_path):
    methods = {"AR lr1": "--lr 1e-3", "AR lr2": "--lr 2e-3", "DLX": "--dilocox"}
    study = _study(tmp_path, methods, ["AR lr1", "AR lr2"])
    assert study.total() == 7  # the losing candidate runs one seed
    assert study.pending() == [("AR lr1", 1), ("AR lr2", 1), ("DLX", 1)]
    _finish(study, "AR lr1", 1, 5.0)
    _finish(study, "AR lr2", 1, 4.8)
    assert study.pending() == [("DLX", 1)]  # every method's first seed before any second one
    _finish(study, "DLX", 1, 5.1)
    assert study.pending() == [("AR lr2", 2), ("DLX", 2), ("AR lr2", 3), ("DLX", 3)]
    # The best candidate is re-decided on the means: a bad second seed hands it to the other one.
    _finish(study, "AR lr2", 2, 5.6)
    assert study.best_baseline() == "AR lr1"
    assert study.pending()[0] == ("AR lr1", 2)
    # A finished run made with other flags is refused, not silently reused.
    changed = _study(tmp_path, {**methods, "DLX": "--dilocox --dilocox-local-steps 5"}, ["AR lr1", "AR lr2"])
    with pytest.raises(SystemExit, match="was run with other flags"):
        changed.pending()
    # Other flags that spell the same settings (a default pinned since) keep it.
    pinned = _study(tmp_path, {**methods, "DLX": "--dilocox --no-dilocox-ef-decay-follows-lr "
                                                 "--dilocox-ef-decay-follows-lr"}, ["AR lr1", "AR lr2"])
    assert pinned.done("DLX", 1)["val_loss"] == 5.1 and pinned.pending() == study.pending()
    # So is one whose flags are the same but whose defaults have changed since it ran.
    path = study.folder("DLX", 1) / "done.json"
    summary = json.loads(path.read_text())
    summary["settings"]["dilocox_outer_lr"] = 0.5
    path.write_text(json.dumps(summary))
    with pytest.raises(SystemExit, match="other settings of dilocox_outer_lr"):
        _study(tmp_path, methods, ["AR lr1", "AR lr2"]).pending()
    # A setting the run's record lacks (a flag added since it ran) is not compared.
    del summary["settings"]["dilocox_outer_lr"]
    # A codec default is compared as the run resolves it (None in the parsed flags: on with topk).
    summary["settings"]["dilocox_keep_unsent"] = False
    path.write_text(json.dumps(summary))
    with pytest.raises(SystemExit, match="other settings of dilocox_keep_unsent"):
        _study(tmp_path, methods, ["AR lr1", "AR lr2"]).pending()
    summary["settings"]["dilocox_keep_unsent"] = True
    path.write_text(json.dumps(summary))
    # An AllReduce run's outer-loop settings do not apply to it: a changed DiLoCoX default keeps it.
    ar_path = study.folder("AR lr1", 1) / "done.json"
    ar = json.loads(ar_path.read_text())
    ar["settings"]["dilocox_keep_unsent"] = "anything"
    ar_path.write_text(json.dumps(ar))
    assert _study(tmp_path, methods, ["AR lr1", "AR lr2"]).pending()[0] == ("AR lr1", 2)


def test_processes_sharing_a_study_take_different_runs(tmp_path):
    methods = {"AR": "", "DLX": "--dilocox", "sync": "--dilocox"}
    first, second = (_study(tmp_path, methods, ["AR"]) for _ in range(2))
    assert first.next_run() == ("AR", 1)
    # Another process (here a live one: this test's parent) holds the first run: the second takes the next.
    claim = first.folder("AR", 1) / "claim.json"
    claim.write_text(json.dumps(dict(host=cs.socket.gethostname(), pid=os.getppid())))
    assert second.next_run() == ("DLX", 1)
    assert first.next_run() == ("sync", 1)
    assert second.next_run() is None  # every pending run is held
    # A claim whose process has died on this host is taken over.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    claim.write_text(json.dumps(dict(host=cs.socket.gethostname(), pid=int(dead.stdout))))
    assert second.next_run() == ("AR", 1)
    second.release("AR", 1)
    assert not claim.exists()


def test_summary_gaps_and_spread(tmp_path):
    study = _study(tmp_path, {"AR": "", "DLX": "--dilocox", "sync": "--dilocox"}, ["AR"], seeds=(1, 2),
                   compare="sync")
    losses = {"AR": [4.00, 4.10], "DLX": [4.40, 4.50], "sync": [4.38, 4.46]}
    for method, values in losses.items():
        for seed, loss in zip((1, 2), values):
            _finish(study, method, seed, loss, nbytes=10_000 if method == "AR" else 100)
    rows = cs.summarize(study)["methods"]
    assert rows["AR"]["val_loss"] == pytest.approx(4.05)
    assert rows["DLX"]["std"] == pytest.approx(statistics.stdev([4.40, 4.50]))
    assert rows["DLX"]["gap"] == pytest.approx(4.45 / 4.05 - 1)
    assert rows["DLX"]["gap_exceeds_spread"]  # 0.40 apart, stds 0.07
    assert rows["DLX"]["gap_compare"] == pytest.approx(4.45 / 4.42 - 1)
    assert not rows["DLX"]["gap_compare_exceeds_spread"]  # 0.03 apart, within the seed spread
    assert rows["DLX"]["bytes_vs_baseline"] == pytest.approx(100)


def test_gap_pairs_seeds(tmp_path, capsys):
    """A method with fewer seeds than its baseline is compared with the same seeds of the baseline."""
    study = _study(tmp_path, {"AR": "", "DLX": "--dilocox"}, ["AR"], seeds=(1, 2, 3))
    for seed, loss in zip((1, 2, 3), (4.00, 4.30, 4.20)):
        _finish(study, "AR", seed, loss, nbytes=10_000)
    _finish(study, "DLX", 2, 4.38, nbytes=100)
    results = cs.summarize(study)
    dlx = results["methods"]["DLX"]
    assert dlx["gap"] == pytest.approx(4.38 / 4.30 - 1)  # not 4.38 / mean(4.0, 4.3, 4.2) - 1
    assert dlx["gap_seeds"] == [2] and "gap_exceeds_spread" not in dlx  # one seed has no spread
    cs.print_table(results)
    out = capsys.readouterr().out
    assert "DLX vs AR: over seed(s) 2 only" in out and "AR vs AR" not in out
    # Seeds finished in another order than the seeds' sort (SEEDS=3,1,2) are still all of them.
    for seed, loss in ((3, 4.41), (1, 4.12)):
        _finish(study, "DLX", seed, loss, nbytes=100)
    results = cs.summarize(study)
    results["methods"]["DLX"]["seeds"] = [3, 1, 2]
    cs.print_table(results)
    assert "only" not in capsys.readouterr().out


def test_refuses_a_study_whose_data_would_repeat(tiny_dataset, tmp_path, capsys):
    def argv(iters):
        return ["--out", str(tmp_path / "s"), "--method", "A=", "--baseline", "A", "--dry-run", "--",
                *PRETRAIN, "--train-iters", str(iters), *_data(tiny_dataset, tmp_path)]

    split_tokens = cs.train_split_tokens(str(tiny_dataset / "c_text_document"), "80,20,0")
    fits = split_tokens // (8 * 64)  # global batch 8 x sequence 64 tokens per iteration
    assert cs.main(argv(fits)) == 0
    assert f"train_split_tokens {split_tokens:,}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cs.main(argv(fits + 1))
    assert "the data would repeat" in capsys.readouterr().err


def test_tiny_study_end_to_end_and_resume(tiny_dataset, tmp_path, capsys):
    argv = ["--out", str(tmp_path / "s"), "--seeds", "1", "--method", "AllReduce=",
            "--method", "DiLoCoX=--dilocox --dilocox-local-steps 3 --dilocox-local-steps-ramp-iters 0", "--baseline", "AllReduce", "--",
            *PRETRAIN, *_data(tiny_dataset, tmp_path)]
    cut = argv.index("--")
    assert cs.main([*argv[:cut], "--report", *argv[cut:]]) == 0  # nothing finished yet, nothing is run
    assert json.loads((tmp_path / "s" / "results.json").read_text())["methods"] == {}
    assert cs.main(argv) == 0
    results = json.loads((tmp_path / "s" / "results.json").read_text())
    assert (tmp_path / "s" / "curves.png").stat().st_size > 0
    ar, dlx = results["methods"]["AllReduce"], results["methods"]["DiLoCoX"]
    for row in (ar, dlx):
        run = row["runs"][0]
        assert [p["tokens"] for p in run["curve"]] == [6 * 8 * 64, 12 * 8 * 64]
        assert run["val_batches"] >= 2 and 0 < run["val_loss_se"] < 1
        assert run["curve"][-1]["val_loss"] == run["val_loss"] < run["curve"][0]["val_loss"]
    assert dlx["rounds"] == 4 and dlx["bytes_per_round"] > 0
    assert dlx["gap"] == pytest.approx(dlx["val_loss"] / ar["val_loss"] - 1)
    capsys.readouterr()
    assert cs.main(argv) == 0  # resumed: both runs are done, nothing is launched
    assert "> [" not in capsys.readouterr().out
    # A run made on other data (the corpus rebuilt in another environment) is refused, not mixed in.
    done = tmp_path / "s" / "runs" / "DiLoCoX" / "seed1" / "done.json"
    summary = json.loads(done.read_text())
    data_bin = next(name for name in summary["data"] if name.endswith(".bin"))
    assert len(summary["data"][data_bin]) == 64  # a SHA-256 of the dataset itself
    summary["data"][data_bin] = "0" * 64
    done.write_text(json.dumps(summary))
    with pytest.raises(SystemExit, match="was run on other data"):
        cs.main(argv)


def test_an_interrupted_run_resumes_from_its_checkpoint(tiny_dataset, tmp_path, capsys):
    """With --checkpoint-interval, a run stopped after its checkpoint at iteration 8 (and a record
    written past it, as a run killed later leaves) resumes from there and ends as the same run
    made in one go: the same validation curve bit for bit, the same byte count (plus the codec's
    handshake, sent again after a resume), the checkpoint removed once it is done."""
    def argv(out):
        return ["--out", str(tmp_path / out), "--seeds", "1", "--checkpoint-interval", "4",
                "--method", "DiLoCoX=--dilocox --dilocox-local-steps 3 --dilocox-local-steps-ramp-iters 0",
                "--baseline", "DiLoCoX", "--", *PRETRAIN, *_data(tiny_dataset, tmp_path)]

    assert cs.main(argv("whole")) == 0
    parser = cs.build_parser()
    args = parser.parse_args(argv("resumed"))
    study = cs.Study(args, cs.check_args(parser, args))
    folder = study.folder("DiLoCoX", 1)
    folder.mkdir(parents=True)
    with open(folder / "log.txt", "w") as log:  # as the study would have made it
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                        f"--master-port={cs.launch_port()}", str(REPO / "pretrain_gpt.py"), *study.flags("DiLoCoX", 1),
                        *study.checkpointing(folder, None), "--exit-interval", "8"],
                       cwd=REPO, check=True, stdout=log, stderr=subprocess.STDOUT, env=worker_env())
    with open(folder / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"iteration": 9, "lm_loss": 9.9, "tokens": 1, "train_s": 1.0}) + "\n")
    capsys.readouterr()
    assert cs.main(argv("resumed")) == 0
    assert "(resumed from its checkpoint at iteration 8)" in capsys.readouterr().out
    whole, resumed = (json.loads((tmp_path / out / "runs" / "DiLoCoX" / "seed1" / "done.json").read_text())
                      for out in ("whole", "resumed"))
    assert resumed["curve"][0]["val_loss"] == whole["curve"][0]["val_loss"]  # at 6, before the stop
    assert resumed["val_loss"] == whole["val_loss"] and resumed["tokens"] == whole["tokens"]
    assert resumed["cross_cluster_bytes"] == whole["cross_cluster_bytes"] + HANDSHAKE_BYTES
    assert not (folder / "ckpt").exists() and (folder / "log.to-8.txt").is_file()
    assert [r["iteration"] for r in cs._records(folder / "metrics.jsonl") if "lm_loss" in r] == [4, 8, 12]


def test_metrics_reader_skips_an_unfinished_last_line_and_names_a_bad_one(tmp_path):
    """The tools' one metrics reader (compare_runs.read_records): a run that is writing (or was
    killed writing) its last line still reads; a damaged line elsewhere is an error naming it."""
    from compare_runs import read_records

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1}\n\n{"iteration": 2}\n{"iterat')
    assert read_records(path) == [{"iteration": 1}, {"iteration": 2}]
    path.write_text('{"iteration": 1}\n{"iteration": 2}')  # a whole last record without its newline
    assert read_records(path) == [{"iteration": 1}, {"iteration": 2}]
    path.write_text('{"iteration": 1}\n{"iterat\n{"iteration": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record"):
        read_records(path)
    path.write_text('[1, 2]\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: not a JSON object"):
        read_records(path)


def test_a_runs_bytes_include_what_its_drained_round_sent():
    """The drained last round (with the final flush) follows the last training record: the run's
    total is the last count any record carries."""
    from compare_runs import final_cross_cluster_bytes

    records = [{"iteration": 10, "lm_loss": 5.0, "cross_cluster_bytes": 100},
               {"outer_step": 1, "drain": False, "cross_cluster_bytes": 150},
               {"iteration": 20, "lm_loss": 4.0, "cross_cluster_bytes": 200},
               {"iteration": 20, "val_loss": 4.1},
               {"outer_step": 2, "drain": True, "bytes_sent": 900, "cross_cluster_bytes": 1100}]
    assert final_cross_cluster_bytes(records) == 1100
    assert final_cross_cluster_bytes(records[:4]) == 200 and final_cross_cluster_bytes(records[3:4]) is None
