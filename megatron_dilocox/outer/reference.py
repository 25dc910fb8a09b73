"""Single-process reference of the DiLoCoX outer loop on C replicas, for tests.

Deliberately plain: per-tensor lists, no threads, no process groups, no flattening, and
``torch.optim.SGD`` as the outer optimizer. It is kept apart from ``sync.py`` so that comparing
the two checks the real implementation against an independent statement of the same math.
"""
from __future__ import annotations

import torch


class ReferenceDiLoCo:
    """C model replicas sharing one outer optimizer.

    Args:
        init: initial parameters, identical for every replica.
        clusters: number of replicas C.
        mode: "sync", "delay", "eager" or "delay-naive".
        lr, momentum, nesterov: outer SGD settings.
    """

    def __init__(self, init, clusters, mode, lr, momentum, nesterov):
        assert mode in ("sync", "delay", "eager", "delay-naive")
        self.mode, self.clusters = mode, clusters
        self.base = [t.detach().clone().float() for t in init]
        self.starts = [[b.clone() for b in self.base] for _ in range(clusters)]
        self.opt = torch.optim.SGD(
            self.base, lr=lr, momentum=momentum, nesterov=nesterov, foreach=False
        )
        self.pending = None  # average launched at the previous boundary (delay modes)

    @torch.no_grad()
    def step(self, replicas):
        """Round boundary: ``replicas[k]`` is cluster k's params after H local steps (in place)."""
        deltas = [[s - p for s, p in zip(start, rep)] for start, rep in zip(self.starts, replicas)]
        g = self._mean(deltas)
        if self.mode == "sync":
            self._apply(g)
            self.starts = [self._copy(self.base) for _ in range(self.clusters)]
        else:
            if self.pending is not None:
                self._apply(self.pending)
            self.pending = g
            if self.mode == "delay":  # keep each replica's own, not yet averaged progress
                self.starts = [[b - d for b, d in zip(self.base, dk)] for dk in deltas]
            elif self.mode == "eager":  # keep only its share of the coming average
                self.starts = [[b - d / self.clusters for b, d in zip(self.base, dk)] for dk in deltas]
            else:
                self.starts = [self._copy(self.base) for _ in range(self.clusters)]
        self._load(replicas)

    @torch.no_grad()
    def land(self, replicas):
        """Mid-round (delay modes): apply the in-flight average; each replica swaps the progress
        it carries for it and keeps what it trained since the boundary."""
        self._apply(self.pending)
        self.pending = None
        for rep, start in zip(replicas, self.starts):
            for p, s, b in zip(rep, start, self.base):
                p.add_(b - s)
        self.starts = [self._copy(self.base) for _ in range(self.clusters)]

    @torch.no_grad()
    def finish(self, replicas):
        """End of training: apply the last in-flight average; every replica becomes ``base``."""
        if self.pending is not None:
            self._apply(self.pending)
            self.pending = None
        self.starts = [self._copy(self.base) for _ in range(self.clusters)]
        self._load(replicas)

    def _mean(self, deltas):
        # Sum in cluster order, then divide. Bitwise equal to allreduce + div for C == 2; for
        # C > 2 a ring allreduce may add in another order (compare with a tolerance).
        out = []
        for i in range(len(self.base)):
            total = deltas[0][i].clone()
            for dk in deltas[1:]:
                total += dk[i]
            out.append(total / self.clusters)
        return out

    def _apply(self, g):
        for b, gi in zip(self.base, g):
            b.grad = gi.clone()
        self.opt.step()

    def _load(self, replicas):
        for rep, start in zip(replicas, self.starts):
            for p, s in zip(rep, start):
                p.copy_(s)

    @staticmethod
    def _copy(tensors):
        return [t.clone() for t in tensors]
