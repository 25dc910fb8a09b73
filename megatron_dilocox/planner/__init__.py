"""Back-of-the-envelope planner: parameters, per-GPU memory, step time and DiLoCoX vs AllReduce.

Pure arithmetic (no torch), used by ``tools/plan.py``. Every estimate is a documented formula,
not a measurement; the only constants are the ones written in these modules, each with its
formulas in its docstring:

* ``shapes``: the model's parameter tensors per TP rank and pipeline stage, and their count;
* ``layout``: the parallel layout and the machine (the units: bytes, seconds, bandwidth in
  Gbit/s, memory in GiB);
* ``memory``: memory per GPU;
* ``step_time``: one inner step, on GPUs or (the calibration runs) CPU processes;
* ``exchange``: the cross-cluster link, AllReduce's gradients and DiLoCoX's payloads;
* ``cost_model``: :func:`plan`, all of the above for one launch;
* ``report``: the plan as text.
"""
from megatron_dilocox.planner.cost_model import Plan, plan
from megatron_dilocox.planner.exchange import AllReduceCost, DiLoCoXCost
from megatron_dilocox.planner.layout import GIB, Layout, Machine
from megatron_dilocox.planner.memory import OUTER_BYTES_PER_PARAM, Memory
from megatron_dilocox.planner.shapes import (ModelShape, Tensor, layer_tensors, outer_tensors, padded_vocab,
                                             param_count, stage_tensors)
from megatron_dilocox.planner.step_time import StepTime, layer_matmul_flops, stage_flops_per_token

__all__ = ["AllReduceCost", "DiLoCoXCost", "GIB", "Layout", "Machine", "Memory", "ModelShape", "OUTER_BYTES_PER_PARAM",
           "Plan", "StepTime", "Tensor", "layer_matmul_flops", "layer_tensors", "outer_tensors", "padded_vocab",
           "param_count", "plan", "stage_flops_per_token", "stage_tensors"]
