"""Single-process reference of the DiLoCoX outer loop on C replicas, for tests.

Deliberately plain: per-tensor lists, no threads, no process groups, no flattening, and
``torch.optim.SGD`` as the outer optimizer. It is kept apart from ``sync.py`` so that comparing
the two checks the real implementation against an independent statement of the same math.
"""
from __future__ import annotations

import torch

from megatron_dilocox.outer.compression import quantize as qz


def quantized_arrival(numels, bits, block):
    """``flush`` for :class:`ReferenceDiLoCo`: a flat residual as it arrives when each of its
    tensors (``numels`` elements each, in order) is sent blockwise quantized on its own."""
    def arrive(flat):
        return torch.cat([qz.dequantize(qz.quantize(part.contiguous(), bits, block))
                          for part in flat.split(list(numels))])
    return arrive


class ReferenceDiLoCo:
    """C model replicas sharing one outer optimizer.

    Args:
        init: initial parameters, identical for every replica.
        clusters: number of replicas C.
        mode: "sync", "delay" or "eager".
        lr, momentum, nesterov: outer SGD settings.
        compressors: one single-cluster compressed reducer per replica (``compressor([flat],
            None) -> [decoded]``, error feedback inside it, its ``residual`` read after each
            call); the mean is then of the replicas' decoded pseudo-gradients. None: exact mean.
        keep_unsent: a replica restarts from ``base`` less its compressor's residual.
        flush: ``flush(residual) -> decoded``, how a compressor's flat residual arrives (for
            example quantized and decoded); given, :meth:`finish` applies the mean of the
            arrived residuals as one more outer step.
        lr_at: ``lr_at(iteration) -> lr`` of the round that ended at that iteration (given to
            :meth:`step`); the flush takes the last round's. None: ``lr`` for every round.
    """

    def __init__(self, init, clusters, mode, lr, momentum, nesterov, compressors=None, keep_unsent=False,
                 flush=None, lr_at=None, final_average=True):
        assert mode in ("sync", "delay", "eager")
        assert not (keep_unsent or flush) or compressors, "keep_unsent and flush need compressors"
        self.mode, self.clusters = mode, clusters
        self.compressors, self.keep_unsent, self.flush = compressors, keep_unsent, flush
        self.base = [t.detach().clone().float() for t in init]
        self.starts = [[b.clone() for b in self.base] for _ in range(clusters)]
        self.opt = torch.optim.SGD(
            self.base, lr=lr, momentum=momentum, nesterov=nesterov, foreach=False
        )
        self.pending = None  # average launched at the previous boundary (delay modes)
        self.lr_at = lr_at or (lambda iteration: lr)
        self.final_average = final_average
        self.launched = 0  # the iteration that ended the round launched last

    @torch.no_grad()
    def step(self, replicas, iteration=0, lr_scale=1.0):
        """Round boundary after ``iteration`` inner steps, where the inner lr is ``lr_scale`` times
        its peak: ``replicas[k]`` is cluster k's params after H local steps (in place)."""
        deltas = [[s - p for s, p in zip(start, rep)] for start, rep in zip(self.starts, replicas)]
        if self.mode == "sync":
            self.launched = iteration
            self._apply(self._mean(deltas, lr_scale=lr_scale))
            self.starts = [self._anchor(k) for k in range(self.clusters)]
        else:
            if self.pending is not None:
                self._apply(self.pending)
            # The restart points use the residuals of the round just applied, not this one's.
            anchors = [self._anchor(k) for k in range(self.clusters)]
            self.pending, self.launched = self._mean(deltas, lr_scale=lr_scale), iteration
            if self.mode == "delay":  # keep each replica's own, not yet averaged progress
                self.starts = [[a - d for a, d in zip(ak, dk)] for ak, dk in zip(anchors, deltas)]
            elif self.mode == "eager":  # keep only its share of the coming average
                self.starts = [[a - d / self.clusters for a, d in zip(ak, dk)] for ak, dk in zip(anchors, deltas)]
            else:
                self.starts = anchors
        self._load(replicas)

    @torch.no_grad()
    def land(self, replicas):
        """Mid-round (delay modes): apply the in-flight average; each replica swaps the progress
        it carries for it and keeps what it trained since the boundary."""
        self._apply(self.pending)
        self.pending = None
        anchors = [self._anchor(k) for k in range(self.clusters)]
        for rep, start, anchor in zip(replicas, self.starts, anchors):
            for p, s, a in zip(rep, start, anchor):
                p.add_(a - s)
        self.starts = anchors

    @torch.no_grad()
    def finish(self, replicas):
        """End of training: apply the last in-flight average (with ``flush``, then the mean
        residual), as they are with ``final_average``; every replica becomes ``base``."""
        if self.pending is not None:
            self._apply(self.pending, self.final_average)
            self.pending = None
        if self.flush is not None:
            owed = [self.flush(c.residual).split([b.numel() for b in self.base]) for c in self.compressors]
            mean = self._mean([[e.view_as(b) for e, b in zip(ek, self.base)] for ek in owed], dense=True)
            self._apply(mean, self.final_average)
            for c in self.compressors:
                c.residual.zero_()
        self.starts = [self._copy(self.base) for _ in range(self.clusters)]
        self._load(replicas)

    def _anchor(self, k):
        """Where replica k restarts from: base, less its unsent progress with keep_unsent."""
        if not self.keep_unsent or self.compressors[k].residual is None:
            return self._copy(self.base)
        residual = self.compressors[k].residual.split([b.numel() for b in self.base])
        return [b - e.view_as(b) for b, e in zip(self.base, residual)]

    def _mean(self, deltas, dense=False, lr_scale=1.0):
        # Sum in cluster order, then divide. Bitwise equal to allreduce + div for C == 2; for
        # C > 2 a ring allreduce may add in another order (compare with a tolerance). ``dense``:
        # of the given deltas as they are, even with compressors (the flush's arrived residuals).
        if self.compressors and not dense:  # each replica's decoded payload, as every rank decodes them all
            deltas = [comp([torch.cat([d.reshape(-1) for d in dk])], None, lr_scale)[0].split([b.numel() for b in self.base])
                      for comp, dk in zip(self.compressors, deltas)]
            deltas = [[d.view_as(b) for d, b in zip(dk, self.base)] for dk in deltas]
        out = []
        for i in range(len(self.base)):
            total = deltas[0][i].clone()
            for dk in deltas[1:]:
                total += dk[i]
            out.append(total / self.clusters)
        return out

    def _apply(self, g, plain=False):
        """One outer step with the lr of the round launched last (the one ``g`` comes from), or
        with ``plain`` ``g`` subtracted as it is."""
        if plain:
            for b, gi in zip(self.base, g):
                b.sub_(gi)
            return
        for b, gi in zip(self.base, g):
            b.grad = gi.clone()
        self.opt.param_groups[0]["lr"] = self.lr_at(self.launched)
        self.opt.step()

    def _load(self, replicas):
        for rep, start in zip(replicas, self.starts):
            for p, s in zip(rep, start):
                p.copy_(s)

    @staticmethod
    def _copy(tensors):
        return [t.clone() for t in tensors]
