"""Start-up time of every command-line tool: the wall clock of ``TOOL --help``, median of N runs.

    python tools/bench_cli.py [--repeats 3]

A tool that imports torch or megatron-core before parsing its flags takes seconds to print its
usage; one that parses first answers in a fraction of a second.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = ("pretrain_gpt.py", "tools/plan.py", "tools/checkpoint/inspect.py", "tools/checkpoint/convert.py",
         "tools/preprocess_data.py", "tools/train_tokenizer.py", "tools/make_corpus.py", "tools/compare_runs.py")


def startup_s(tool: str) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, tool, "--help"], cwd=REPO, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"bench_cli.py: error: {tool} --help exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return elapsed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs per tool (the median is printed)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    print(f"{'tool':32s} {'--help s':>9s}")
    for tool in TOOLS:
        print(f"{tool:32s} {statistics.median(startup_s(tool) for _ in range(args.repeats)):9.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
