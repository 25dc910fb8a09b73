"""The training loop: batches -> megatron schedule -> inner step -> (every H) outer sync.

Per-step collectives stay inside a cluster: the schedule's pipeline p2p, DDP's gradient
reduction and the optimizer's grad-norm reduction run on the cluster-local groups of
:class:`~megatron_dilocox.topology.Topology`; the training loss is reduced only at log
intervals, over the cluster's data-parallel group.

The loop knows nothing of the checkpoint format: it is handed a ``save_checkpoint`` function
and offers its state as :meth:`Trainer.state_dict` / :meth:`Trainer.load_state_dict`.
"""

import contextlib
import time
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_dilocox import interrupt
from megatron_dilocox.errors import ClusterLossError
from megatron_dilocox.megatron_state import leaf_optimizers, main_params, model_sharded_state_dict, push_to_model
from megatron_dilocox.platform.backend import device
from megatron_dilocox.run_config import RunConfig
from megatron_dilocox.training.data import MicroBatches


def _loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum()
    return loss, tokens.to(torch.int), {"lm loss": torch.stack([loss.detach(), tokens])}


def forward_step(data_iterator, model):
    """megatron's forward-step contract: (output, loss function of the output)."""
    batch = {key: value.to(device(), non_blocking=True) for key, value in next(data_iterator).items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


class Trainer:
    """Runs ``--train-iters`` steps, evaluating and logging as the flags say.

    ``save_checkpoint(iteration, state, weights) -> folder`` writes a checkpoint (called at
    ``--save-interval`` and at the end when ``--save`` is set): ``state`` is :meth:`state_dict`,
    ``weights`` a context manager factory yielding megatron's sharded state dict of the weights
    to keep (the global ones under DiLoCoX).
    """

    def __init__(self, run: RunConfig, topo, model, optimizer, scheduler, train_data, valid_data, logger,
                 dilocox=None, audit=None, save_checkpoint=None):
        """Reads the run's training, evaluation and logging, and checkpointing sections."""
        self.training, self.logging, self.checkpoint = run.training, run.logging, run.checkpoint
        self.seq_length = run.model.seq_length
        self.topo = topo
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.logger = logger
        self.dilocox = dilocox
        self.audit = audit
        self.save_checkpoint = save_checkpoint
        batch, micro = run.training.global_batch_size, run.training.micro_batch_size
        self.train_batches = MicroBatches(train_data, batch, micro, topo.data_parallel_size, topo.data_parallel_rank)
        # Each cluster evaluates the whole validation batch on its own replicas.
        self.valid_batches = MicroBatches(valid_data, batch, micro, topo.inner_dp_size, topo.inner_dp_rank)
        self.is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.schedule = get_forward_backward_func()
        self.eval_round = 0
        self.final_val_loss = None
        self.eval_s = 0.0  # duration of the last evaluation
        self.start_iteration = 0  # set by load_state_dict
        self.window_loss = torch.zeros(2, dtype=torch.float64)  # loss and tokens since the last log

    def _run_schedule(self, batches: MicroBatches, step: int, forward_only: bool):
        iterators = [batches.step(step) for _ in self.model]
        losses = self.schedule(
            forward_step_func=forward_step,
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=batches.num_microbatches,
            seq_length=self.seq_length,
            micro_batch_size=batches.micro_batch_size,
            forward_only=forward_only,
        )
        if not self.is_last_stage:
            return torch.zeros(2, dtype=torch.float64)
        return torch.stack([x["lm loss"] for x in losses]).sum(0).double().cpu()

    def _sum_over_replicas(self, loss_and_tokens: torch.Tensor) -> torch.Tensor:
        """(..., 2) loss and token sums, summed over the cluster's data-parallel replicas."""
        total = loss_and_tokens.to(device())
        dist.all_reduce(total, group=self.topo.pg_collection.dp)
        return total.cpu()

    def _mean_over_replicas(self, loss_and_tokens: torch.Tensor) -> float:
        """Token-weighted mean loss over the cluster's data-parallel replicas (last stage only)."""
        if not self.is_last_stage:
            return float("nan")
        total = self._sum_over_replicas(loss_and_tokens)
        return float(total[0] / total[1])

    def _phase(self, name: str) -> None:
        if self.audit is not None:
            self.audit.phase = name

    def train_step(self, step: int):
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss = self._run_schedule(self.train_batches, step, forward_only=False)
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        return loss, grad_norm

    def lr_scale(self) -> float:
        """How far the inner lr has decayed from its peak: its lr over the peak, 1 during the warm-up."""
        if self.scheduler.num_steps <= self.scheduler.lr_warmup_steps:
            return 1.0
        return self.optimizer.param_groups[0]["lr"] / self.scheduler.max_lr

    @torch.no_grad()
    def evaluate(self, iteration: int) -> float:
        self._phase("eval")
        start = time.perf_counter()
        for chunk in self.model:
            chunk.eval()
        if self.logging.full_validation:  # the same batches every time: the whole split, once
            self.eval_round = 0
            batches = len(self.valid_batches.dataset) // self.valid_batches.global_batch_size
        else:
            batches = self.logging.eval_iters
        per_batch = torch.zeros(batches, 2, dtype=torch.float64)
        for b in range(batches):
            per_batch[b] = self._run_schedule(self.valid_batches, self.eval_round, forward_only=True)
            self.eval_round += 1
        for chunk in self.model:
            chunk.train()
        val_loss = val_loss_se = float("nan")
        if self.is_last_stage:
            per_batch = self._sum_over_replicas(per_batch)
            val_loss = float(per_batch[:, 0].sum() / per_batch[:, 1].sum())
            # Standard error of the validation loss from the spread of its batches' mean losses.
            if batches > 1:
                val_loss_se = float((per_batch[:, 0] / per_batch[:, 1]).std() / batches ** 0.5)
        self.eval_s = time.perf_counter() - start
        self.logger.evaluation(iteration, val_loss, eval_s=self.eval_s, val_loss_se=val_loss_se, batches=batches)
        return val_loss

    def _evaluate_global(self, iteration: int) -> float:
        """Validation on the global parameters (the outer ones under DiLoCoX)."""
        with self._global_weights():
            return self.evaluate(iteration)

    def state_dict(self) -> dict:
        """This rank's training state for a checkpoint, as references (serialize it before
        training on): the validation position, the LR schedule, the running loss window, the
        inner optimizer's fp32 main params (the weights themselves) and states, DiLoCoX's, and the
        cross-cluster byte tallies (after DiLoCoX's, which waits for the round in flight)."""
        return {"eval_round": self.eval_round, "scheduler": self.scheduler.state_dict(),
                "window_loss": self.window_loss, "main_params": main_params(self.optimizer),
                "optimizers": [opt.optimizer.state_dict() for opt in leaf_optimizers(self.optimizer)],
                "dilocox": None if self.dilocox is None else self.dilocox.state_dict(),
                "audit": None if self.audit is None else self.audit.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restores the entries of :meth:`state_dict` that ``state`` has, plus ``iteration``
        (where training resumes): the progress (``iteration``, ``eval_round``, ``scheduler``) and,
        for an exact resume, all of the rest together. ValueError on a mismatch of settings."""
        if "iteration" in state:
            self.start_iteration = state["iteration"]
            if self.dilocox is not None:  # an exact resume then restores the saved rounds below
                self.dilocox.start_at(self.start_iteration)
        if "eval_round" in state:
            self.eval_round = state["eval_round"]
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        elif "iteration" in state:  # a checkpoint without its schedule: it follows the iteration
            self.scheduler.step(increment=state["iteration"])
        if "main_params" not in state:
            return
        params, saved = main_params(self.optimizer), state["main_params"]
        if [tuple(p.shape) for p in params] != [tuple(p.shape) for p in saved]:
            raise ValueError("main parameter shapes differ from this rank's")
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
        for opt, opt_state in zip(leaf_optimizers(self.optimizer), state["optimizers"], strict=True):
            opt.optimizer.load_state_dict(opt_state)
        push_to_model(self.optimizer)
        if (state["dilocox"] is None) != (self.dilocox is None):
            raise ValueError("saved " + ("without" if state["dilocox"] is None else "with") + " --dilocox")
        if self.dilocox is not None:
            self.dilocox.load_state_dict(state["dilocox"])
        self.window_loss.copy_(state["window_loss"])
        if state["audit"] is not None and self.audit is not None:  # None: saved before it was kept
            self.audit.load_state_dict(state["audit"])

    @contextlib.contextmanager
    def _global_weights(self, drained: bool = False):
        """The global weights (the outer ones under DiLoCoX; ``drained``: with the in-flight
        round applied) in the model while open."""
        with self.dilocox.global_params(drained) if self.dilocox is not None else contextlib.nullcontext():
            yield

    @contextlib.contextmanager
    def _saved_weights(self):
        """megatron's sharded state dict of the weights a checkpoint keeps."""
        with self._global_weights(drained=True):
            yield model_sharded_state_dict(self.model)

    def save(self, iteration: int) -> float:
        """Saves a checkpoint; returns the seconds it took (kept out of the throughput figures)."""
        self._phase("checkpoint")
        start = time.perf_counter()
        folder = self.save_checkpoint(iteration, self.state_dict(), self._saved_weights)
        took = time.perf_counter() - start
        self.logger.print(f"  saved checkpoint at iteration {iteration:8d} to {folder} ({took:.1f} s)")
        return took

    def _saving_on_loss(self, iteration: int, outer_call, *call_args):
        """``outer_call(*call_args)``; when too few clusters are left to go on (ClusterLossError),
        saves a checkpoint first (with ``--save``): a resumed run loses none of this cluster's work."""
        try:
            return outer_call(*call_args)
        except ClusterLossError as err:
            if self.checkpoint.save:
                self.logger.print(f"> {err}: saving a checkpoint before stopping")
                self.save(iteration)
            raise

    def train(self) -> None:
        training, logging, checkpoint = self.training, self.logging, self.checkpoint
        tokens_per_step = training.global_batch_size * self.seq_length
        window_loss = self.window_loss
        start = window_start = time.perf_counter()
        # Validation and checkpoint saves pause the training clock (as Megatron's interval timer):
        # tokens_per_sec and train_s measure training alone, elapsed_s is the wall clock.
        paused = 0.0
        saved = None
        iteration = self.start_iteration
        while iteration < training.train_iters:
            iteration += 1
            interrupt.check()  # Ctrl-C stops here, between iterations
            self._phase("step")
            loss, grad_norm = self.train_step(iteration - 1)
            window_loss += loss
            # The last iteration ends a round too: what the replicas trained since the last
            # boundary is sent, not dropped by finish().
            if self.dilocox is not None and (self.dilocox.is_boundary(iteration) or iteration == training.train_iters):
                self._phase("boundary")
                self.logger.outer_round(self._saving_on_loss(iteration, self.dilocox.step, iteration, self.lr_scale()))
            elif self.dilocox is not None and self.dilocox.is_landing(iteration):
                self._phase("boundary")
                self._saving_on_loss(iteration, self.dilocox.land)
            joined = self.dilocox.take_rejoin() if self.dilocox is not None else None
            if joined is not None:
                self.logger.print(f"> joined the running clusters from a live peer at iteration {joined} "
                                  f"(this cluster was at {iteration}; its progress since its start is dropped)")
                self.scheduler.step(increment=joined - iteration)  # the schedule and the data follow the iteration
                iteration = joined
                # and the validation batches: where a cluster that never stopped has got to, the
                # evaluations before this iteration's (which comes below) done
                self.eval_round = ((joined - 1) // logging.eval_interval) * logging.eval_iters
                window_loss.zero_()
                window_start = time.perf_counter()
            if iteration % logging.log_interval == 0 and joined is None:  # a join starts an empty window
                now = time.perf_counter()
                per_iter = (now - window_start) / logging.log_interval
                self.logger.train(
                    iteration=iteration,
                    lm_loss=self._mean_over_replicas(window_loss),
                    lr=self.optimizer.param_groups[0]["lr"],
                    grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                    tokens=iteration * tokens_per_step,
                    tokens_per_sec=tokens_per_step / per_iter,
                    elapsed_s=now - start,
                    train_s=now - start - paused,
                    ms_per_iter=per_iter * 1000.0,
                    consumed_samples=iteration * training.global_batch_size,
                    global_batch_size=training.global_batch_size,
                    cross_cluster_bytes=self.audit.cross_cluster_bytes() if self.audit else None,
                )
                window_loss.zero_()
                window_start = time.perf_counter()
            off_clock = 0.0
            if iteration % logging.eval_interval == 0 and iteration != training.train_iters and logging.eval_iters:
                self._evaluate_global(iteration)
                off_clock += self.eval_s
            if checkpoint.save and checkpoint.save_interval and iteration % checkpoint.save_interval == 0:
                saved = iteration
                off_clock += self.save(iteration)
            paused += off_clock
            window_start += off_clock
            exit_interval = checkpoint.exit_interval
            if exit_interval and iteration % exit_interval == 0 and iteration != training.train_iters:
                # Stop without draining: the in-flight round is in the checkpoint.
                if checkpoint.save and saved != iteration:
                    self.save(iteration)
                if self.dilocox is not None:
                    self.dilocox.stop()
                self.logger.print(f"> exiting after iteration {iteration} (--exit-interval {exit_interval})")
                return
        if self.dilocox is not None:
            self._phase("boundary")
            record = self._saving_on_loss(training.train_iters, self.dilocox.finish)
            if record is not None:
                self.logger.outer_round(record)
        if checkpoint.save and saved != training.train_iters and training.train_iters > self.start_iteration:
            self.save(training.train_iters)
        if logging.eval_iters:
            self.final_val_loss = self.evaluate(training.train_iters)
