"""OuterNesterov against torch.optim.SGD, and DiLoCoXConfig validation."""
import io

import pytest
import torch

from megatron_dilocox.config import DiLoCoXConfig
from megatron_dilocox.outer.optimizer import OuterNesterov

SHAPES = [(37,), (5, 7), (3, 4, 2), (1031,)]  # odd sizes: vectorised bodies and scalar tails


def _tensors(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * scale for s in SHAPES]


@pytest.mark.parametrize(
    "lr,momentum,nesterov", [(0.7, 0.9, True), (0.7, 0.9, False), (0.3, 0.0, False), (1.1, 0.5, True)]
)
def test_matches_torch_sgd_bitwise(lr, momentum, nesterov):
    ours, theirs = _tensors(0), _tensors(0)
    opt = OuterNesterov(ours, lr=lr, momentum=momentum, nesterov=nesterov)
    ref = torch.optim.SGD(theirs, lr=lr, momentum=momentum, nesterov=nesterov, foreach=False)
    for step in range(8):
        grads = _tensors(100 + step, scale=0.1)
        kept = [g.clone() for g in grads]
        opt.step(grads)
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        ref.step()
        assert all(torch.equal(a, b) for a, b in zip(grads, kept)), "step must not modify grads"
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max()}"
    assert not torch.equal(ours[0], _tensors(0)[0])


def test_state_dict_round_trip_continues_bitwise():
    full, part = _tensors(1), _tensors(1)
    opt_full = OuterNesterov(full)
    opt_part = OuterNesterov(part)
    for step in range(3):
        opt_full.step(_tensors(10 + step, 0.1))
        opt_part.step(_tensors(10 + step, 0.1))
    buf = io.BytesIO()
    torch.save({"params": part, "opt": opt_part.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    resumed = [p.clone() for p in saved["params"]]
    opt_resumed = OuterNesterov(resumed)
    opt_resumed.load_state_dict(saved["opt"])
    assert opt_resumed.steps == 3
    for step in range(3, 6):
        opt_full.step(_tensors(10 + step, 0.1))
        opt_resumed.step(_tensors(10 + step, 0.1))
    assert all(torch.equal(a, b) for a, b in zip(full, resumed))


def test_optimizer_rejects_bad_input():
    with pytest.raises(ValueError, match="fp32"):
        OuterNesterov([torch.ones(3, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="momentum > 0"):
        OuterNesterov([torch.ones(3)], momentum=0.0, nesterov=True)
    opt = OuterNesterov([torch.ones(3)])
    with pytest.raises(ValueError, match="grads"):
        opt.step([])
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict({"steps": 1, "momentum_buffers": [torch.ones(4)]})


def test_config_defaults_are_valid():
    cfg = DiLoCoXConfig()
    cfg.validate()
    assert (cfg.clusters, cfg.local_steps, cfg.sync_mode, cfg.landing) == (2, 10, "delay", 1)
    assert (cfg.peak_outer_lr, cfg.outer_lr_warmup_iters, cfg.outer_momentum, cfg.use_nesterov) == (2.4, 600, 0.0, False)
    # The default outer lr grows with the clusters averaged (1 + 2.8 (1 - 1/C)); a given one is kept.
    assert [DiLoCoXConfig(clusters=c).peak_outer_lr for c in (1, 2, 4, 8)] == pytest.approx([1.0, 2.4, 3.1, 3.45])
    assert DiLoCoXConfig(clusters=4, outer_lr=1.7).peak_outer_lr == 1.7
    four = DiLoCoXConfig(clusters=4)
    assert [four.outer_lr_at(i) for i in (0, 300, 600, 900)] == pytest.approx([1.0, 2.05, 3.1, 3.1])
    assert cfg.ramp_iters == 1000 and [cfg.local_steps_at(i) for i in (0, 100, 999, 1000)] == [1, 2, 10, 10]
    adaptive = DiLoCoXConfig(max_local_steps=40)
    adaptive.validate()  # adaptive H sets H itself: no ramp unless asked for (which it refuses)
    assert adaptive.ramp_iters == 0 and adaptive.local_steps_at(0) == 10


def test_min_local_steps_floors_the_ramp():
    """The ramp's rounds stay at or above --dilocox-min-local-steps; from where the ramp passes it,
    and after the ramp, nothing changes."""
    plain, floored = DiLoCoXConfig(), DiLoCoXConfig(min_local_steps=3)
    floored.validate()
    its = (0, 99, 100, 199, 200, 299, 300, 650, 999, 1000, 5000)
    assert [plain.local_steps_at(i) for i in its] == [1, 1, 2, 2, 3, 3, 4, 7, 10, 10, 10]
    assert [floored.local_steps_at(i) for i in its] == [3, 3, 3, 3, 3, 3, 4, 7, 10, 10, 10]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"clusters": 0}, "--dilocox-clusters must be >= 1, got 0"),
        ({"local_steps": 0}, "--dilocox-local-steps must be >= 1, got 0"),
        ({"sync_mode": "async"}, "--dilocox-sync-mode must be one of sync, delay, eager,"),
        ({"outer_lr": 0.0}, "--dilocox-outer-lr must be > 0"),
        ({"outer_lr": float("nan")}, "--dilocox-outer-lr must be > 0"),
        ({"outer_momentum": 1.0}, r"--dilocox-outer-momentum must be in \[0, 1\)"),
        ({"outer_momentum": -0.1}, r"--dilocox-outer-momentum must be in \[0, 1\)"),
        ({"outer_timeout_s": 0.0}, "--dilocox-outer-timeout-s must be > 0"),
        ({"min_local_steps": 2, "local_steps_ramp_iters": 0}, "--dilocox-min-local-steps bounds the H ramp"),
        ({"min_local_steps": 11}, r"need 1 <= --dilocox-min-local-steps <= --dilocox-local-steps, got 11, 10"),
    ],
)
def test_config_validation_names_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        DiLoCoXConfig(**kwargs).validate()
    assert "\n" not in str(info.value)


def test_plain_sgd_config_is_valid():
    for nesterov in (True, False):  # without momentum the outer step is plain SGD either way
        cfg = DiLoCoXConfig(outer_momentum=0.0, nesterov=nesterov)
        cfg.validate()
        assert not cfg.use_nesterov
    assert DiLoCoXConfig(outer_momentum=0.5).use_nesterov
    assert not DiLoCoXConfig(outer_momentum=0.5, nesterov=False).use_nesterov
