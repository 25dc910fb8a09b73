"""What this process computes on, decided in one place.

With a CUDA device visible to torch: the local rank's GPU, NCCL process groups by default, and
what needs a GPU (Transformer Engine layers, fused kernels, offloading the outer state). Without
one: the CPU and gloo, where megatron-core runs through the bridge of :mod:`.cpu`, which an
entry point installs (:func:`megatron_dilocox.platform.cpu.prepare`) before it imports
megatron-core. The project asks this module, not ``torch.cuda``.
"""

import os

import torch


def on_cuda() -> bool:
    """Whether this process computes on a CUDA device."""
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device this rank computes on."""
    return torch.device("cuda", torch.cuda.current_device()) if on_cuda() else torch.device("cpu")


def process_group_backend(requested: str | None) -> str:
    """``--distributed-backend`` when given, else NCCL on CUDA and gloo on the CPU."""
    return requested or ("nccl" if on_cuda() else "gloo")


def use_local_device() -> None:
    """With CUDA, makes this rank's GPU (``LOCAL_RANK`` modulo the devices) the current one."""
    if on_cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
