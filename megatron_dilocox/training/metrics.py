"""Console lines in Megatron-LM's format, a JSON-lines metrics file, TensorBoard, W&B.

Only one rank writes (the last one, which holds the last pipeline stage and hence the loss).
"""

import json
import math
import os
import time

from megatron_dilocox.errors import ConfigError
from megatron_dilocox.run_config import LoggingConfig
from megatron_dilocox.training.round_record import OuterRound


# TensorBoard and W&B tags: Megatron-LM's names (its training.py) for what both log, so that
# dashboards built on Megatron-LM runs read ours; other fields keep their metrics-file names,
# DiLoCoX's round fields under "dilocox/" (the drain's at the end under "dilocox/drain/").
MEGATRON_TAGS = {"lm_loss": "lm loss", "lr": "learning-rate", "grad_norm": "grad-norm",
                 "global_batch_size": "batch-size", "iteration_time_s": "iteration-time",
                 "val_loss": "lm loss validation", "val_ppl": "lm loss validation ppl"}
VS_SAMPLES = frozenset(MEGATRON_TAGS.values()) - {"iteration-time"}
"""Tags TensorBoard also gets against the samples consumed ("<tag> vs samples"), as Megatron-LM writes them."""


def _timestamp():
    return time.strftime("%Y-%m-%d %H:%M:%S")


class MetricsLogger:
    """Writes what the training loop reports, on the writing rank only."""

    def __init__(self, logging: LoggingConfig, train_iters: int, global_batch_size: int, is_writer: bool,
                 settings: dict | None = None):
        """``settings``: the run's flags, kept with a W&B run."""
        self.is_writer = is_writer
        self.train_iters = train_iters
        self.global_batch_size = global_batch_size
        self.metrics_file = None
        self.tensorboard = None
        self.wandb = None
        if not is_writer:
            return
        if logging.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(logging.metrics_file)), exist_ok=True)
            self.metrics_file = open(logging.metrics_file, "a", buffering=1)
        if logging.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("--tensorboard-dir needs tensorboard: pip install tensorboard") from None
            self.tensorboard = SummaryWriter(log_dir=logging.tensorboard_dir)
        if logging.wandb_project:
            try:
                import wandb
            except ImportError:
                raise ConfigError("--wandb-project needs wandb: pip install wandb") from None
            self.wandb = wandb.init(project=logging.wandb_project, name=logging.wandb_exp_name,
                                    dir=logging.wandb_save_dir, config=settings)

    def print(self, message: str) -> None:
        if self.is_writer:
            print(message, flush=True)

    def _record(self, record: dict, prefix: str = "", board: dict | None = None) -> None:
        """Writes ``record`` to the metrics file and its numbers to TensorBoard and W&B (tags:
        :data:`MEGATRON_TAGS`, else ``prefix`` + the key), with ``board``'s scalars too."""
        if self.metrics_file:
            self.metrics_file.write(json.dumps(record) + "\n")
        if not (self.tensorboard or self.wandb):
            return
        step = record["iteration"]
        fields = {**record, **(board or {})}
        scalars = {MEGATRON_TAGS.get(key, prefix + key): value for key, value in fields.items()
                   if key != "iteration" and isinstance(value, (int, float)) and not isinstance(value, bool)}
        if self.tensorboard:
            samples = step * self.global_batch_size  # Megatron-LM's consumed_train_samples
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, step)
                if tag in VS_SAMPLES:
                    self.tensorboard.add_scalar(f"{tag} vs samples", value, samples)
        if self.wandb:
            self.wandb.log(scalars, step=step)

    def train(self, iteration, lm_loss, lr, grad_norm, tokens, tokens_per_sec, elapsed_s, train_s,
              ms_per_iter, consumed_samples, global_batch_size, cross_cluster_bytes=None):
        if not self.is_writer:
            return
        self.print(
            f" [{_timestamp()}] iteration {iteration:8d}/{self.train_iters:8d} |"
            f" consumed samples: {consumed_samples:12d} |"
            f" elapsed time per iteration (ms): {ms_per_iter:.1f} |"
            f" throughput (tokens/s): {tokens_per_sec:.1f} |"
            f" learning rate: {lr:.6E} | global batch size: {global_batch_size:5d} |"
            f" lm loss: {lm_loss:.6E} | grad norm: {grad_norm:.3f} |"
            + (f" cross-cluster bytes: {cross_cluster_bytes} |" if cross_cluster_bytes is not None else ""))
        record = dict(iteration=iteration, lm_loss=lm_loss, lr=lr, grad_norm=grad_norm,
                      tokens=tokens, tokens_per_sec=tokens_per_sec, elapsed_s=elapsed_s, train_s=train_s)
        if cross_cluster_bytes is not None:
            record["cross_cluster_bytes"] = cross_cluster_bytes
        self._record(record, board={"global_batch_size": global_batch_size, "iteration_time_s": ms_per_iter / 1000.0})

    def evaluation(self, iteration, val_loss, eval_s, val_loss_se, batches, label="validation"):
        """``val_loss_se``: standard error of ``val_loss`` over its ``batches`` batches (nan for one)."""
        if not self.is_writer:
            return
        ppl = math.exp(min(20.0, val_loss))
        line = f" {label} loss at iteration {iteration} | lm loss value: {val_loss:.6E} | lm loss PPL: {ppl:.6E} |"
        self.print("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
        self._record(dict(iteration=iteration, val_loss=val_loss, val_ppl=ppl, eval_s=eval_s,
                          val_loss_se=val_loss_se, val_batches=batches))

    def outer_round(self, r: OuterRound):
        """One DiLoCoX round boundary (or the drain at the end)."""
        if not self.is_writer:
            return
        c = r.compression
        self.print(
            f" [{_timestamp()}] {'outer drain' if r.drain else 'outer step '} {r.outer_step:5d}"
            f" at iteration {r.iteration:8d} |"
            f" cross-cluster bytes sent: {r.bytes_sent:12d} | comm (s): {r.comm_s:.3f} |"
            f" wait (s): {r.wait_s:.3f} | clusters: {r.participants} | pseudo-grad norm: {r.pseudo_grad_norm:.4E} |"
            + (f" next H: {r.local_steps} |" if r.local_steps is not None else "")
            + (f" cross-cluster bytes between boundaries: {r.cross_cluster_bytes_between_boundaries} |"
               if r.cross_cluster_bytes_between_boundaries is not None else "")
            + (f" dense bytes: {c.dense_bytes} | compression: {c.compression_ratio:.1f}x |"
               f" rel. error: {c.rel_error:.3f} |" + (f" mean rank: {c.mean_rank:.2f} |" if c.mean_rank else "")
               + f" codec (s): {c.codec_s:.3f} |" if c is not None else "")
            + (" SKIPPED (non-finite) |" if r.skipped else ""))
        # The drain shares its iteration with the last round: its own tags, or W&B (one value
        # per tag and step) would keep only one of the two.
        self._record(r.metrics(), prefix="dilocox/drain/" if r.drain else "dilocox/")

    def memory(self, iteration: int, peak_gpu_bytes: int, peak_pinned_bytes: int | None) -> None:
        """This rank's peak GPU memory (torch's allocator) and peak pinned host memory (torch's
        caching host allocator, which rounds blocks up to powers of two; None: not reported)."""
        if not self.is_writer:
            return
        pinned = None if peak_pinned_bytes is None else peak_pinned_bytes / 2**30
        self.print(f"> peak GPU memory: {peak_gpu_bytes / 2**30:.2f} GiB"
                   + (f", peak pinned host memory: {pinned:.2f} GiB" if pinned is not None else ""))
        record = dict(iteration=iteration, peak_gpu_memory_gib=peak_gpu_bytes / 2**30)
        if pinned is not None:
            record["peak_pinned_host_gib"] = pinned
        self._record(record)

    def close(self):
        if self.metrics_file:
            self.metrics_file.close()
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()
