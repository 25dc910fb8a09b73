"""Emulated slow links between clusters (network namespaces + veth + bridge + tc tbf). Needs root.

    python tools/wan up --clusters 2 --rate 10mbit          # namespaces dlx-hub, dlx-c0, dlx-c1
    python tools/wan status
    python tools/wan launch --nproc-per-node 2 -- pretrain_gpt.py --dilocox ...
    python tools/wan launch --cluster-jobs --nproc-per-node 2 -- pretrain_gpt.py --dilocox ...
    python tools/wan down

``launch`` runs one torchrun job across the clusters (cluster k = node rank k, in namespace
dlx-c<k>, rendezvous at dlx-c0's address, gloo on the shaped interface); with
``--cluster-jobs``, one torchrun job per cluster at its own address and a torchft Lighthouse in
dlx-c0 that joins them (docs/reliability.md). See docs/benchmarks.md.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import launch  # noqa: E402
import netns  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python tools/wan", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("up", "down", "status", "launch"):
        p = sub.add_parser(name)
        p.add_argument("--prefix", default="dlx", help="name prefix of the namespaces (default dlx)")
        if name == "up":
            p.add_argument("--clusters", type=int, required=True, help="number of cluster namespaces")
            p.add_argument("--rate", required=True, help="uplink and downlink rate per cluster, e.g. 10mbit, 1gbit")
            p.add_argument("--subnet", default="10.213.0.0/24", help="addresses of the clusters")
        if name == "launch":
            p.add_argument("--nproc-per-node", type=int, required=True, help="ranks per cluster")
            p.add_argument("--master-port", type=int, default=29500)
            p.add_argument("--cluster-jobs", action="store_true",
                           help="one torchrun job per cluster joined by a Lighthouse (DiLoCoX only)")
            p.add_argument("--lighthouse-port", type=int, default=29510, help="with --cluster-jobs")
            p.add_argument("--max-restarts", type=int, default=0,
                           help="with --cluster-jobs: torchrun restarts a failed cluster's job this often; "
                                "the restarted cluster rejoins from a live peer")
            p.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...] run by torchrun")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    launch.exit_on_sigterm()
    if args.command == "launch":
        script = args.script[1:] if args.script[:1] == ["--"] else args.script
        if not script:
            parser.error("launch: give the training script and its flags after --")
        if args.nproc_per_node < 1:
            parser.error(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
        if args.max_restarts and not args.cluster_jobs:
            parser.error("--max-restarts needs --cluster-jobs (a job across the clusters restarts as a whole)")
        if args.max_restarts < 0:
            parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    try:
        netns.check_prefix(args.prefix)
        wan = netns.Wan(args.prefix, args.clusters, args.rate, args.subnet) if args.command == "up" else None
        netns.require_root(os.geteuid())
        if args.command == "up":
            netns.up(wan)
            print(f"up: {args.clusters} clusters at {args.rate}: " +
                  ", ".join(f"{wan.namespace(k)} {wan.address(k)}" for k in range(args.clusters)))
        elif args.command == "down":
            removed = netns.down(args.prefix)
            print(f"down: removed {', '.join(removed) if removed else 'nothing'}")
        elif args.command == "status":
            clusters = netns.status(args.prefix)
            if not clusters:
                print(f"no namespaces with prefix {args.prefix!r}")
            for c in clusters:
                rate = f"{c['rate_bits'] / 1e6:g} Mbit/s" if c["rate_bits"] else "unshaped"
                print(f"{c['namespace']:<14} {c['address']:<15} {rate:>14}  tx {c['tx_bytes']:,} B  rx {c['rx_bytes']:,} B")
        else:
            clusters = netns.status(args.prefix)
            if not clusters:
                raise netns.WanError(f"no namespaces with prefix {args.prefix!r}; run `python tools/wan up` first")
            namespaces = [c["namespace"] for c in clusters]
            if args.cluster_jobs:
                lighthouse, jobs = launch.cluster_jobs(namespaces, [c["address"] for c in clusters],
                                                       args.nproc_per_node, script, args.master_port,
                                                       args.lighthouse_port, args.max_restarts)
                launch.run(jobs, service=lighthouse)
            else:
                launch.run(launch.spanning_job(namespaces, clusters[0]["address"], args.nproc_per_node, script,
                                               args.master_port))
    except netns.WanError as err:
        print(f"wan: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
