"""Pretrain a GPT model with megatron-core; with --dilocox, across clusters joined by slow links.

    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 256 ... --data-path PREFIX

Without --dilocox this is the vanilla AllReduce baseline: gradients are reduced over all
data-parallel ranks every step. Run ``python pretrain_gpt.py --help`` for every flag.
"""

import json
import multiprocessing
import os
import signal
import sys
import time

from megatron_dilocox import interrupt
from megatron_dilocox.arguments import parse_args
from megatron_dilocox.errors import CheckpointError, ClusterLossError, ConfigError, StateDivergedError, missing_dependency

PROG = "pretrain_gpt.py"


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _error(message: str) -> int:
    """Reports a one-line error; returns the exit status.

    Under torchrun, every rank that meets the error writes it to its error file, and torchrun's
    failure summary names it: printing from rank 0 alone loses it whenever another rank exits
    first and torchrun kills rank 0 before it prints. Elsewhere rank 0 prints it.
    """
    line = f"{PROG}: error: {message}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        # The layout of torch.distributed.elastic's own error files; without a "py_callstack" the
        # summary shows the message itself.
        with open(error_file, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
    elif _is_rank0():
        print(line, file=sys.stderr)
    return 2


def _interrupted(save: str | None) -> int:
    """One line from rank 0 on Ctrl-C: what was kept."""
    # A save in flight is not published, and its writer processes would keep the interpreter from
    # exiting (it joins them; they wait for someone to read their results).
    for child in multiprocessing.active_children():
        child.terminate()
    if _is_rank0():
        if not save:
            kept = "nothing kept (no --save)"
        else:
            from megatron_dilocox.checkpoint import files

            try:
                kept = f"last checkpoint {files.latest(save)} (resume with --load {save})"
            except CheckpointError:
                kept = f"no checkpoint saved in {save} yet"
        print(f"{PROG}: interrupted: {kept}", file=sys.stderr, flush=True)
    return 128 + signal.SIGINT


def main(argv=None) -> int:
    try:
        run_config = parse_args(argv)
    except ConfigError as err:
        return _error(str(err))
    interrupt.install()
    try:
        from megatron_dilocox.platform import cpu

        cpu.prepare()  # before megatron-core is imported: without CUDA it must see the CPU
        from megatron_dilocox.job import run  # heavy imports after --help and flag checks

        run(run_config)
    except (ConfigError, ClusterLossError, StateDivergedError) as err:
        return _error(str(err))
    except ModuleNotFoundError as err:
        return _error(missing_dependency(err))
    except KeyboardInterrupt:
        return _interrupted(run_config.checkpoint.save)
    return 0


if __name__ == "__main__":  # the guard is needed: checkpoint writers start spawn processes
    sys.exit(main())
