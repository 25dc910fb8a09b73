"""Layout invariance: the same seed and data give the same losses on every TP/PP/VPP/DP layout."""

import json

import pytest

from launch import REPO, read_jsonl, torchrun

MODEL = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6", "--lr", "3e-3",
         "--lr-warmup-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--eval-iters", "0",
         "--eval-interval", "1000"]
LAYOUTS = {
    "tp2_pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    "pp4_vpp": ["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1"],
    "tp2_dp2_distopt": ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
}


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    spec = out / "spec.json"
    spec.write_text(json.dumps([{"name": name, "flags": MODEL + flags} for name, flags in LAYOUTS.items()]))
    torchrun(4, REPO / "tests" / "scenarios.py", [str(out), str(spec)])
    (out / "ref.json").write_text(json.dumps([{"name": "tp1_pp1", "flags": MODEL}]))
    torchrun(1, REPO / "tests" / "scenarios.py", [str(out), str(out / "ref.json")])
    return {name: [r["lm_loss"] for r in read_jsonl(out / f"{name}.metrics.jsonl")]
            for name in [*LAYOUTS, "tp1_pp1"]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_match_single_process(losses, layout):
    reference = losses["tp1_pp1"]
    assert len(reference) == 6 and reference[0] > 4.0
    assert reference[-1] < reference[0], "the reference run must learn, or the comparison says little"
    assert losses[layout] == pytest.approx(reference, rel=1e-5)
