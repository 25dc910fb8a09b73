"""Outer optimizer: SGD with (Nesterov) momentum over the fp32 shard a rank owns."""
from __future__ import annotations

from typing import Any, Sequence

import torch


class OuterNesterov:
    """SGD with optional (Nesterov) momentum, updating fp32 tensors in place.

    The update is exactly that of ``torch.optim.SGD(params, lr, momentum, nesterov=nesterov,
    dampening=0, weight_decay=0, foreach=False)``, op for op, so results match it bit for bit::

        buf = g                      (first step)
        buf = momentum * buf + g     (later steps)
        d   = g + momentum * buf     (nesterov)    or    d = buf    (otherwise)
        p   = p - lr * d

    Only elementwise ops in a fixed order: equal inputs give bitwise-equal outputs on every
    rank, which keeps the outer state (momentum included) identical across clusters.

    Args:
        params: fp32 tensors updated in place (the outer "base" parameters).
        lr: outer learning rate.
        momentum: momentum factor in [0, 1); 0 means plain SGD with no buffer.
        nesterov: use Nesterov momentum (needs momentum > 0).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        lr: float = 0.7,
        momentum: float = 0.9,
        nesterov: bool = True,
    ):
        if lr <= 0:
            raise ValueError(f"outer lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"outer momentum must be in [0, 1), got {momentum}")
        if nesterov and momentum == 0:
            raise ValueError("Nesterov momentum needs momentum > 0")
        self.params = list(params)
        for p in self.params:
            if p.dtype != torch.float32:
                raise ValueError(f"outer params must be fp32, got {p.dtype}")
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.momentum_buffers: list[torch.Tensor | None] = [None] * len(self.params)
        self.steps = 0

    @torch.no_grad()
    def step(self, grads: Sequence[torch.Tensor]) -> None:
        """Applies one update with ``grads`` (one per param; not modified)."""
        if len(grads) != len(self.params):
            raise ValueError(f"expected {len(self.params)} grads, got {len(grads)}")
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if self.momentum != 0:
                buf = self.momentum_buffers[i]
                if buf is None:
                    buf = self.momentum_buffers[i] = g.clone()
                else:
                    buf.mul_(self.momentum).add_(g)
                g = g.add(buf, alpha=self.momentum) if self.nesterov else buf
            p.add_(g, alpha=-self.lr)
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        """Returns the state (references, not copies: save it before the next step)."""
        return {"steps": self.steps, "momentum_buffers": list(self.momentum_buffers)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a state from :meth:`state_dict` (buffers are copied)."""
        bufs = state["momentum_buffers"]
        if len(bufs) != len(self.params):
            raise ValueError(f"state has {len(bufs)} momentum buffers, expected {len(self.params)}")
        for p, b in zip(self.params, bufs):
            if b is not None and b.shape != p.shape:
                raise ValueError(f"momentum buffer shape {tuple(b.shape)} != param {tuple(p.shape)}")
        self.momentum_buffers = [
            None if b is None else b.detach().to(p.device, torch.float32, copy=True)
            for p, b in zip(self.params, bufs)
        ]
        self.steps = int(state["steps"])
