"""Pretrain a GPT model with megatron-core; with --dilocox, across clusters joined by slow links.

    torchrun --nproc-per-node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 256 ... --data-path PREFIX

Without --dilocox this is the vanilla AllReduce baseline: gradients are reduced over all
data-parallel ranks every step. Run ``python pretrain_gpt.py --help`` for every flag.
"""

import os
import sys

from megatron_dilocox.arguments import ConfigError, parse_args


def _error(err: ConfigError) -> int:
    """One line, from one rank (every rank checks alike and exits alike)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"pretrain_gpt.py: error: {err}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except ConfigError as err:
        return _error(err)
    from megatron_dilocox.training.setup import run  # heavy imports after --help and flag checks

    try:
        run(args)
    except ConfigError as err:
        return _error(err)
    return 0


if __name__ == "__main__":  # the guard is needed: checkpoint writers start spawn processes
    sys.exit(main())
