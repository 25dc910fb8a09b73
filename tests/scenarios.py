"""Runs several training scenarios in one torchrun launch (start-up dominates CPU tests).

    torchrun --nproc-per-node N tests/scenarios.py OUT_DIR SPEC_JSON

SPEC_JSON is a list of {"name": str, "flags": [pretrain_gpt.py flags]}; a spec with
"expect_error": true records the ConfigError setup raises (OUT_DIR/NAME.error.RANK.txt) instead
of training, and fails if there is none. Per scenario it writes
OUT_DIR/NAME.metrics.jsonl (the run's metrics file), OUT_DIR/NAME.params.RANK.pt (full
parameters of the rank's pipeline stage, from TP rank 0 of each cluster's first replica) and
OUT_DIR/NAME.info.RANK.json. Under DiLoCoX it checks after every round that the global
parameters are bit-identical across clusters and records per round whether it was skipped, kept
base unchanged and left the replica at base; "inject_nan": {"rank": R, "iteration": I} puts a NaN
into one parameter of rank R just before the round boundary after iteration I.
"""

import hashlib
import json
import sys

import torch
import torch.distributed as dist

from megatron_dilocox.platform import cpu

cpu.prepare()  # before megatron-core is imported
from megatron_dilocox.arguments import parse_args  # noqa: E402
from megatron_dilocox.errors import ConfigError  # noqa: E402
from megatron_dilocox.job import setup  # noqa: E402
from megatron_dilocox.training.model import gather_full_params  # noqa: E402
from megatron.core import parallel_state  # noqa: E402


def _checked_rounds(trainer, info):
    """Wraps the round boundary with a cross-cluster hash check of the global parameters."""
    boundary = trainer.dilocox.step
    sync = trainer.dilocox.sync
    info["rounds"] = []

    def step(iteration, *args):
        before = hashlib.sha256(sync.base.numpy().tobytes()).hexdigest()
        record = boundary(iteration, *args)
        digest = hashlib.sha256(sync.base.numpy().tobytes()).hexdigest()
        everyone = [None] * trainer.topo.clusters
        dist.all_gather_object(everyone, digest, group=trainer.topo.outer_group)
        assert len(set(everyone)) == 1, f"global params differ across clusters after iteration {iteration}"
        info["hash_checks"] += 1
        info["rounds"].append({"skipped": record.skipped, "base_kept": digest == before,
                               "at_base": bool(torch.equal(sync.round_start, sync.base))})
        return record

    trainer.dilocox.step = step


def _measured_norms(trainer, info, tied):
    """Test hook for one-stage, TP1 layouts in sync mode, where every rank holds its replica's
    whole model and a round starts from the weights the previous boundary left: the distance each
    round moved them, from the model's full weights alone, to check the logged pseudo-gradient norm."""
    boundary = trainer.dilocox.step
    start = gather_full_params(trainer.model, tied)
    info["round_norms"] = []

    def step(iteration, *args):
        nonlocal start
        now = gather_full_params(trainer.model, tied)
        info["round_norms"].append(sum(float((start[n] - now[n]).double().pow(2).sum()) for n in now) ** 0.5)
        record = boundary(iteration, *args)
        start = gather_full_params(trainer.model, tied)
        return record

    trainer.dilocox.step = step


def _inject_nan(trainer, at):
    """Test hook: a NaN in this rank's first outer parameter right before the boundary of
    iteration ``at["iteration"]``, on rank ``at["rank"]`` only."""
    boundary = trainer.dilocox.step

    def step(iteration, *args):
        if iteration == at["iteration"] and dist.get_rank() == at["rank"]:
            with torch.no_grad():
                trainer.dilocox.outer_params[0].view(-1)[0] = float("nan")
        return boundary(iteration, *args)

    trainer.dilocox.step = step


def run(spec, out):
    name = spec["name"]
    args = parse_args(spec["flags"] + ["--metrics-file", f"{out}/{name}.metrics.jsonl"])
    if spec.get("expect_error"):
        try:
            setup(args)
        except ConfigError as err:
            with open(f"{out}/{name}.error.{dist.get_rank()}.txt", "w") as f:
                f.write(str(err))
            parallel_state.destroy_model_parallel()
            return
        raise AssertionError(f"scenario {name}: expected a ConfigError, setup succeeded")
    trainer = setup(args)
    rank = dist.get_rank()
    info = {"hash_checks": 0}
    if trainer.dilocox is not None:
        info["param_numel"] = sum(p.numel() for p in trainer.dilocox.params)
        info["outer_numel"] = sum(p.numel() for p in trainer.dilocox.outer_params)
        info["outer_numels"] = [p.numel() for p in trainer.dilocox.outer_params]
        if "inject_nan" in spec:
            _inject_nan(trainer, spec["inject_nan"])
        _checked_rounds(trainer, info)
        if spec.get("measure_norms"):
            _measured_norms(trainer, info, tied=not args.model.untie_embeddings_and_output_weights)
    trainer.train()
    info["final_val_loss"] = trainer.final_val_loss
    info["start_iteration"] = trainer.start_iteration
    full = gather_full_params(trainer.model, tied=not args.model.untie_embeddings_and_output_weights)
    if parallel_state.get_tensor_model_parallel_rank() == 0 and trainer.topo.inner_dp_rank == 0:
        torch.save(full, f"{out}/{name}.params.{rank}.pt")
    with open(f"{out}/{name}.info.{rank}.json", "w") as f:
        json.dump(info, f)
    if trainer.audit is not None:
        trainer.audit.uninstall()
    trainer.logger.close()
    dist.barrier()
    parallel_state.destroy_model_parallel()


def main():
    out, spec_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        specs = json.load(f)
    for spec in specs:
        run(spec, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
