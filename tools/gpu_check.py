"""The CUDA path on one GPU, end to end, in one prepared run (sized for a few minutes; not yet timed on a device).

    python tools/gpu_check.py --prepare      # where PyPI is reachable: the wheels a CUDA PyTorch image lacks
    bash tools/gpu_check.sh                  # on the GPU machine, offline: installs them, then runs this

1. **Vanilla**, bf16, one rank, mock data, a ~350M and a ~1.3B GPT (Megatron-LM's shapes):
   tokens/s, model FLOP utilisation (the planner's model FLOPs per token x tokens/s over the
   device's peak dense bf16 FLOP/s, stated), peak GPU memory, each beside the planner's prediction.
2. **DiLoCoX**, the ~350M model: two clusters of one rank sharing the GPU, each its own job joined
   by a torchft Lighthouse (``python -m megatron_dilocox.launch``; the outer exchange runs on host
   memory over gloo), bf16, the default codec (top-k) on the GPU, with and without
   ``--dilocox-offload-outer-state``: every round delivered by both clusters (each payload carries a
   SHA-256 of its sender's global parameters, which the receiver compares with its own), the same
   final SHA-256 on both, the loss falling, tokens/s against vanilla's on the same GPU, peak GPU
   and pinned host memory beside the planner's.
3. **The CUDA-only tests.**

Each part prints its table when it finishes and ``--out``/results.json collects every figure; a
part that fails prints the end of its log and the others still run (exit status 1).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from compare_runs import read_records  # noqa: E402

GPU_IMAGE_LACKS = ("megatron-core", "torchft", "protobuf", "googleapis-common-protos", "opentelemetry-api",
                   "opentelemetry-sdk", "opentelemetry-proto", "opentelemetry-semantic-conventions",
                   "opentelemetry-exporter-otlp-proto-http", "opentelemetry-exporter-otlp-proto-common",
                   "opentelemetry-exporter-http-transport", "opentelemetry-exporter-otlp-common")
"""What a CUDA PyTorch image (torch, numpy, sentencepiece, transformers, pytest, hypothesis) lacks
to run the project: megatron-core, and torchft with what it imports. Versions: constraints-cpu.txt."""
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")

PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200", 989.4),
                    ("A100", 312.0), ("B200", 2250.0))
"""Dense bf16 peak by device name (the first entry whose name the device's contains), from the
vendors' datasheets without sparsity; any other device needs --peak-tflops."""

CUDA_TESTS = ("tests/test_compression_cuda.py",
              "tests/test_outer_sync.py::test_offloaded_outer_state_lives_in_pinned_host_memory_and_changes_nothing")


@dataclass(frozen=True)
class Size:
    """A GPT shape and its batch (vanilla's; each DiLoCoX cluster runs the same)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    micro_batch: int
    global_batch: int


SIZES = {
    "350m": Size(24, 1024, 16, 2048, 4, 8),
    "1.3b": Size(24, 2048, 16, 2048, 2, 8),
    "tiny": Size(2, 64, 4, 64, 2, 4),  # what the CPU test runs
}
VOCAB = 32000


def constraint_pins(path: Path, python_version: str) -> dict[str, str]:
    """Package name -> pinned version of a constraints file, markers evaluated for ``python_version``."""
    from packaging.requirements import Requirement

    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"python_version": python_version,
                                                       "python_full_version": python_version + ".0"}):
            pins[req.name.lower()] = str(req.specifier).removeprefix("==").split("+")[0]
    return pins


def prepare(wheels: Path, python_version: str) -> int:
    """Downloads the wheels of :data:`GPU_IMAGE_LACKS` for Linux x86-64 CPython ``python_version``."""
    pins = constraint_pins(REPO / "constraints-cpu.txt", python_version)
    missing = [p for p in GPU_IMAGE_LACKS if p not in pins]
    if missing:
        print(f"gpu_check: error: constraints-cpu.txt pins no version of {', '.join(missing)}", file=sys.stderr)
        return 2
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "--dest", str(wheels),
           *[arg for platform in WHEEL_PLATFORMS for arg in ("--platform", platform)],
           *[f"{p}=={pins[p]}" for p in GPU_IMAGE_LACKS]]
    code = subprocess.call(cmd)
    if code == 0:
        size = sum(f.stat().st_size for f in wheels.glob("*.whl"))
        print(f"> {len(list(wheels.glob('*.whl')))} wheels for Python {python_version} in {wheels}/ "
              f"({size / 2**20:.1f} MiB); on the GPU machine: bash tools/gpu_check.sh")
    return code


# -- figures from a run's metrics file ----------------------------------------------------------

def steady_tokens_per_sec(records: list[dict]) -> float:
    """Median tokens/s over the logging windows after the first (which holds the warm-up)."""
    rates = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r]
    if len(rates) < 2:
        raise ValueError(f"need at least 2 logging windows, got {len(rates)}")
    return statistics.median(rates[1:])


def losses(records: list[dict]) -> tuple[float, float]:
    """The first and the last logged training loss."""
    values = [r["lm_loss"] for r in records if "lm_loss" in r]
    return values[0], values[-1]


def memory(records: list[dict]) -> tuple[float | None, float | None]:
    """Peak GPU and peak pinned host memory in GiB (``MetricsLogger.memory``'s record)."""
    last = next((r for r in reversed(records) if "peak_gpu_memory_gib" in r), {})
    return last.get("peak_gpu_memory_gib"), last.get("peak_pinned_host_gib")


def rounds(records: list[dict]) -> dict:
    """A DiLoCoX run's exchanges (the rounds applied, the drain's included): how many, how many
    both clusters delivered, and the final fingerprint."""
    applied = [r for r in records if "outer_step" in r and r.get("bytes_sent")]
    drain = next((r for r in records if r.get("drain")), {})

    def median(key: str) -> float | None:
        return statistics.median(r.get(key, 0.0) for r in applied) if applied else None

    return dict(rounds=len(applied), full=sum(r["participants"] == 2 for r in applied),
                global_sha256=drain.get("global_sha256"), comm_s=median("comm_s"), codec_s=median("codec_s"),
                wait_s=sum(r["wait_s"] for r in applied))


def peak_tflops(device_name: str, given: float | None) -> float:
    if given is not None:
        return given
    for name, tflops in PEAK_BF16_TFLOPS:
        if name in device_name:
            return tflops
    raise SystemExit(f"gpu_check: error: no peak bf16 FLOP/s known for {device_name!r}: give --peak-tflops")


# -- the runs -----------------------------------------------------------------------------------

def model_flags(size: Size, iters: int, bf16: bool, global_batch: int | None = None) -> list[str]:
    return ["--num-layers", str(size.layers), "--hidden-size", str(size.hidden),
            "--num-attention-heads", str(size.heads), "--seq-length", str(size.seq),
            "--max-position-embeddings", str(size.seq), "--micro-batch-size", str(size.micro_batch),
            "--global-batch-size", str(global_batch or size.global_batch), "--train-iters", str(iters),
            "--lr", "3e-4", "--lr-warmup-iters", str(max(1, iters // 8)), "--recompute-granularity", "selective",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
            "--log-interval", str(max(1, iters // 5)), "--eval-interval", str(iters), "--eval-iters", "0",
            *(["--bf16"] if bf16 else [])]


def run_logged(cmd: list[str], log: Path, timeout_s: float) -> None:
    """Runs ``cmd`` in the repo with its output in ``log``; RuntimeError with the log's end on failure.
    A run past ``timeout_s`` is killed with its whole process group (torchrun's workers hold the GPU)."""
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = f"timeout after {timeout_s:.0f} s"
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({code}); the end of {log}:\n{tail}")
    print(f"  ({time.monotonic() - start:.0f} s, log {log})", flush=True)


def predict(flags: list[str], gpu_memory_gib: float):
    """The planner's plan of a launch on one GPU per rank (tools/plan.py's reading of the flags, its
    default machine otherwise), its model shape and the ``--gpu-tflops`` it assumed."""
    import plan as plan_cli
    from megatron_dilocox.planner import plan

    args = plan_cli.resolve(["--gpus-per-cluster", "1", "--gpu-memory-gib", str(gpu_memory_gib), "--", *flags])
    model, *rest = plan_cli.configs(args)
    return plan(model, *rest), model, args.gpu_tflops


def gib(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


class Check:
    """One run of the check: the device, each part's figures (``results``) and what failed."""

    def __init__(self, args):
        import torch

        self.args, self.out = args, Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.cuda = torch.cuda.is_available()
        if not self.cuda and not args.allow_cpu:
            raise SystemExit("gpu_check: error: no CUDA device visible to torch (--allow-cpu runs the plumbing on the CPU)")
        if self.cuda:
            props = torch.cuda.get_device_properties(0)
            self.device, self.device_gib = props.name, props.total_memory / 2**30
        else:
            self.device, self.device_gib = "CPU", 80.0
        self.peak = peak_tflops(self.device, args.peak_tflops)
        self.results: dict = dict(device=self.device, torch=torch.__version__, peak_bf16_tflops=self.peak,
                                  vanilla={}, dilocox={}, failures=[])
        from megatron_dilocox.platform import cpu

        cpu.quiet_fallback_warnings()  # before megatron-core is imported
        import megatron.core
        from megatron_dilocox.training.model import uses_transformer_engine

        spec = "Transformer Engine" if uses_transformer_engine() else "local (Transformer Engine does not import)"
        self.results.update(megatron_core=megatron.core.__version__, layer_spec=spec)
        print(f"> {self.device} ({self.device_gib:.0f} GiB), torch {torch.__version__}, megatron-core "
              f"{megatron.core.__version__}, {self.results['layer_spec']} layer spec; MFU against "
              f"{self.peak:g} TFLOP/s dense bf16", flush=True)

    def save(self) -> None:
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=1))
        os.replace(tmp, self.out / "results.json")

    def part(self, name: str, fn) -> None:
        try:
            fn()
        except Exception as err:  # a failed part is reported; the others still run
            print(f"! {name} FAILED: {err}", flush=True)
            self.results["failures"].append(f"{name}: {str(err).splitlines()[0]}")
        self.save()

    def vanilla(self, name: str) -> None:
        size, iters = SIZES[name], self.args.iters
        flags = model_flags(size, iters, bf16=self.cuda)
        metrics = self.out / f"vanilla-{name}.jsonl"
        metrics.unlink(missing_ok=True)
        print(f"> vanilla {name}: {size.layers} x {size.hidden}, seq {size.seq}, micro-batch {size.micro_batch}, "
              f"global {size.global_batch}, {iters} iterations", flush=True)
        run_logged([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
                    str(self.args.master_port), "pretrain_gpt.py", *flags, "--metrics-file", str(metrics)],
                   self.out / f"vanilla-{name}.log", self.args.run_timeout_s)
        records = read_records(metrics)
        from megatron_dilocox.planner.step_time import stage_flops_per_token

        predicted, model, assumed_tflops = predict(flags, self.device_gib)
        tokens_s = steady_tokens_per_sec(records)
        flops_per_token = stage_flops_per_token(model, 1, 1, 0)
        achieved = tokens_s * flops_per_token / 1e12
        step_s = size.global_batch * size.seq / tokens_s
        gpu, _ = memory(records)
        row = dict(params=predicted.params, tokens_per_sec=tokens_s, step_s=step_s, achieved_tflops=achieved,
                   mfu=achieved / self.peak, peak_gpu_gib=gpu, loss=losses(records),
                   planner_gpu_gib=predicted.memory.gpu_total / 2**30, planner_step_s=predicted.step.total,
                   planner_gpu_tflops=assumed_tflops)
        self.results["vanilla"][name] = row
        print(f"  {predicted.params / 1e6:,.0f}M parameters: {tokens_s:,.0f} tokens/s, step {step_s:.3f} s, "
              f"MFU {100 * row['mfu']:.1f}% ({achieved:.0f} TFLOP/s of model FLOPs), peak GPU memory "
              f"{gib(gpu)} GiB; loss {row['loss'][0]:.3f} -> {row['loss'][1]:.3f}", flush=True)
        against = f" ({row['planner_gpu_gib'] / gpu:.2f}x measured)" if gpu else ""
        print(f"  planner (--gpu-tflops {assumed_tflops:g}): step {predicted.step.total:.3f} s "
              f"({predicted.step.total / step_s:.2f}x measured; --gpu-tflops {achieved:.0f} matches it), "
              f"GPU memory {row['planner_gpu_gib']:.2f} GiB{against}", flush=True)

    def dilocox(self, offload: bool) -> None:
        name, iters = self.args.sizes[0], self.args.dilocox_iters
        size = SIZES[name]
        label = "offloaded" if offload else "on the device"
        # Each cluster runs vanilla's batch, so each process does vanilla's work per iteration.
        flags = [*model_flags(size, iters, bf16=self.cuda, global_batch=2 * size.global_batch), "--dilocox",
                 "--dilocox-local-steps", str(self.args.local_steps), "--dilocox-local-steps-ramp-iters", "0",
                 *(["--dilocox-offload-outer-state"] if offload else [])]
        metrics = self.out / f"dilocox-{'offloaded' if offload else 'device'}.jsonl"
        cluster1 = metrics.with_suffix(".cluster-1.jsonl")
        for m in (metrics, cluster1):
            m.unlink(missing_ok=True)
        print(f"> DiLoCoX {name}, outer state {label}: 2 clusters x 1 rank on one device, H {self.args.local_steps}, "
              f"{iters} iterations", flush=True)
        run_logged([sys.executable, "-m", "megatron_dilocox.launch", "--clusters", "2", "--nproc-per-cluster", "1",
                    "--", "pretrain_gpt.py", *flags, "--metrics-file", str(metrics)],
                   self.out / f"{metrics.stem}.log", self.args.run_timeout_s)
        clusters = [read_records(metrics), read_records(cluster1)]
        predicted, _, _ = predict([*flags, "--dilocox-clusters", "2"], self.device_gib)
        each = [rounds(r) for r in clusters]
        tokens_s = steady_tokens_per_sec(clusters[0])  # the global batch's: both clusters' tokens
        vanilla = self.results["vanilla"].get(name, {}).get("tokens_per_sec")
        mem = [memory(r) for r in clusters]
        row = dict(tokens_per_sec=tokens_s, vs_vanilla=tokens_s / vanilla if vanilla else None,
                   loss=[losses(r) for r in clusters], rounds=each[0]["rounds"],
                   rounds_both_delivered=min(e["full"] for e in each),
                   same_final_sha256=each[0]["global_sha256"] is not None
                   and each[0]["global_sha256"] == each[1]["global_sha256"],
                   exchange=[{k: e[k] for k in ("comm_s", "codec_s", "wait_s")} for e in each],
                   peak_gpu_gib=[m[0] for m in mem], peak_pinned_gib=[m[1] for m in mem],
                   planner_gpu_gib=predicted.memory.gpu_total / 2**30,
                   planner_pinned_gib=predicted.memory.host_outer_state / 2**30)
        self.results["dilocox"][label] = row
        problems = []
        if row["rounds"] == 0 or row["rounds_both_delivered"] != row["rounds"]:
            problems.append(f"{row['rounds_both_delivered']} of {row['rounds']} rounds delivered by both clusters")
        if not row["same_final_sha256"]:
            problems.append(f"final global parameters differ: {each[0]['global_sha256']} against {each[1]['global_sha256']}")
        if not all(last < first for first, last in row["loss"]):
            problems.append(f"the loss did not fall: {row['loss']}")
        ratio = f" ({row['vs_vanilla']:.2f}x vanilla's)" if row["vs_vanilla"] else ""
        print(f"  {tokens_s:,.0f} tokens/s{ratio}; {row['rounds']} rounds, {row['rounds_both_delivered']} delivered by "
              f"both clusters, final SHA-256 {'equal' if row['same_final_sha256'] else 'DIFFERENT'}; loss "
              + ", ".join(f"{a:.3f} -> {b:.3f}" for a, b in row["loss"]), flush=True)
        print("  per round (cluster 0 / 1): exchange " + " / ".join(f"{e['comm_s']:.3f}" for e in each)
              + " s median, codec " + " / ".join(f"{e['codec_s']:.3f}" for e in each) + " s median; training "
              "waited " + " / ".join(f"{e['wait_s']:.2f}" for e in each) + " s in all", flush=True)
        print(f"  peak GPU memory {' / '.join(map(gib, row['peak_gpu_gib']))} GiB (planner {row['planner_gpu_gib']:.2f}), "
              f"peak pinned host {' / '.join(map(gib, row['peak_pinned_gib']))} GiB "
              f"(planner's outer state {row['planner_pinned_gib']:.2f})", flush=True)
        if problems:
            raise RuntimeError("; ".join(problems))

    def tests(self) -> None:
        print(f"> the CUDA-only tests: {' '.join(CUDA_TESTS)}", flush=True)
        log = self.out / "cuda_tests.log"
        run_logged([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS], log,
                   self.args.run_timeout_s)
        self.results["cuda_tests"] = log.read_text().strip().splitlines()[-1]
        print(f"  {self.results['cuda_tests']}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tools/gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--prepare", action="store_true", help="download the wheels into --wheels and stop (needs PyPI)")
    p.add_argument("--wheels", default="gpu_wheels", help="where --prepare puts the wheels (default gpu_wheels)")
    p.add_argument("--python-version", default="3.12", help="with --prepare: the GPU machine's Python (default 3.12)")
    p.add_argument("--out", default="runs/gpu_check", help="logs, metrics and results.json (default runs/gpu_check)")
    p.add_argument("--sizes", default="350m,1.3b", help=f"vanilla model sizes, of {', '.join(SIZES)}; DiLoCoX "
                   "runs the first (default 350m,1.3b)")
    p.add_argument("--iters", type=int, default=40, help="vanilla iterations (default 40)")
    p.add_argument("--dilocox-iters", type=int, default=40, help="DiLoCoX iterations (default 40)")
    p.add_argument("--local-steps", type=int, default=5, help="DiLoCoX H (default 5)")
    p.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, for a device not in the table")
    p.add_argument("--run-timeout-s", type=float, default=300.0, help="bound on each run (default 300)")
    p.add_argument("--master-port", type=int, default=29530, help="the vanilla runs' rendezvous port (default 29530)")
    p.add_argument("--skip-tests", action="store_true", help="leave out the CUDA-only tests")
    p.add_argument("--allow-cpu", action="store_true", help="run on the CPU without CUDA (fp32, no offload, "
                   "no CUDA tests): checks the plumbing, not the GPU")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.prepare:
        return prepare(REPO / args.wheels, args.python_version)
    args.sizes = args.sizes.split(",")
    unknown = [s for s in args.sizes if s not in SIZES]
    if unknown:
        build_parser().error(f"--sizes: unknown {', '.join(unknown)} (known: {', '.join(SIZES)})")
    start = time.monotonic()
    check = Check(args)
    for name in args.sizes:
        check.part(f"vanilla {name}", lambda name=name: check.vanilla(name))
    for offload in (False, True) if check.cuda else (False,):
        check.part(f"DiLoCoX offload={offload}", lambda offload=offload: check.dilocox(offload))
    if check.cuda and not args.skip_tests:
        check.part("CUDA tests", check.tests)
    failures = check.results["failures"]
    print(f"> done in {time.monotonic() - start:.0f} s; {args.out}/results.json"
          + (f"; FAILED: {'; '.join(failures)}" if failures else ""), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
