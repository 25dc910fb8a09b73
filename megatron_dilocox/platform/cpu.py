"""Run megatron-core on CPU with gloo.

megatron-core assumes CUDA in a handful of places: it allocates small tensors on
``device="cuda"`` or ``torch.cuda.current_device()``, seeds and forks the CUDA RNG,
calls ``torch.cuda.synchronize()``, moves tensors with ``.cuda()`` and checks
``param.type() == 'torch.cuda.FloatTensor'``.
Instead of editing megatron, every ``megatron.core`` module gets its own view of ``torch``
(:class:`_CpuTorch`): a copy of torch's namespace in which "cuda" means "cpu". Every other
name is torch's own function, so model compute costs exactly what it costs without the bridge. Two tensor methods are patched globally,
which is safe only because CUDA is absent: ``.cuda()`` returns the tensor itself, and
``.type()`` reports CPU tensors under their CUDA type name.

:func:`install` does nothing when CUDA is available (as :mod:`.backend` decides); it also
silences megatron-core's warnings that are expected on CPU (missing Transformer Engine and apex,
CUDA stream advice): :data:`NOTE` is the one line that says so instead. An entry point calls
:func:`prepare` before it imports megatron-core; nothing installs the bridge as a side effect of
an import.
"""

import functools
import importlib
import logging
import sys
import types
import warnings

import torch

from megatron_dilocox.platform.backend import on_cuda

# Every megatron-core module, including those imported later, gets the CPU view of torch; so does
# Megatron-LM's own package shipped with megatron-core 0.17+ (the tests run its checkpoint code).
_PREFIX = ("megatron.core", "megatron.training")
_FACTORIES = ("empty", "full", "ones", "tensor", "zeros", "arange", "randn", "rand")


def _cpu_device(device):
    """Maps a CUDA device spec (``"cuda"``, ``"cuda:0"``, an index) to ``"cpu"``."""
    if device is None:
        return None
    if isinstance(device, int) or str(device).startswith("cuda"):
        return "cpu"
    return device


def _on_cpu(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return wrapper


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as megatron sees it on CPU: the current device is the CPU, the RNG
    is the CPU generator, synchronisation and streams are no-ops."""

    def __init__(self):
        super().__init__("torch.cuda")
        self.__dict__.update(torch.cuda.__dict__)
        self.current_device = lambda: "cpu"
        self.synchronize = lambda *a, **k: None
        self.get_rng_state = lambda *a, **k: torch.get_rng_state()
        self.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        self.manual_seed = lambda seed: torch.manual_seed(seed)
        self.device_count = lambda: 1
        self.current_stream = lambda *a, **k: None
        self.is_available = lambda: False



class _CpuTorch(types.ModuleType):
    """``torch`` with CUDA allocations redirected to the CPU (see module docstring)."""

    def __init__(self):
        super().__init__("torch")
        # A copy of torch's namespace: attribute lookups cost what they cost on torch itself.
        self.__dict__.update(torch.__dict__)
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):  # submodules imported after this view was made
        return getattr(torch, name)


_CPU_TORCH = _CpuTorch()
_installed = False

# megatron-core announces its pure-torch fallbacks at import, once per module and process: expected
# without Transformer Engine and apex (always on CPU), and nothing the user can act on; 0.19 also
# calls its multimodal config experimental at import.
_FALLBACK_WARNINGS = (r"Apex is not installed", r"Transformer Engine and Apex are not installed",
                      r"full scope is deprecated", r"MimoModelConfig is experimental")
# Log records of the same kind, by logger: megatron-core 0.19 deprecates GPTModel (the model this
# package builds) and the synchronous save path its own save takes, and torch's CUDA build on a
# machine without a GPU says that it found no CUDA runtime.
_FALLBACK_LOG_RECORDS = {
    "megatron.core.models.gpt.gpt_model": "GPTModel IS DEPRECATED",
    "megatron.core.dist_checkpointing.strategies.torch": "MCore's async save is deprecated",
    "torch.utils.cpp_extension": "No CUDA runtime is found",
}


def _lacks(message: str, record: logging.LogRecord) -> bool:
    return message not in record.getMessage()


_LOG_FILTERS = {logger: functools.partial(_lacks, message) for logger, message in _FALLBACK_LOG_RECORDS.items()}
# Advice for CUDA streams, given for every tensor-parallel layer.
_CUDA_ONLY_WARNINGS = (r"When using async grad allreduce it is recommended to set the environment variable "
                       r"CUDA_DEVICE_MAX_CONNECTIONS",)
NOTE = "> CPU: gloo process groups, megatron-core's local layer spec and its torch fallbacks for apex"


def quiet_fallback_warnings() -> None:
    """Silences megatron-core's notices about missing Transformer Engine and apex and its
    deprecations of what this package uses: call before megatron-core is imported."""
    for message in _FALLBACK_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for logger, record_filter in _LOG_FILTERS.items():
        logging.getLogger(logger).addFilter(record_filter)  # once: addFilter skips a filter it holds


def _cpu_tensor_type(original):
    """``Tensor.type()`` that reports CPU float tensors as their CUDA twin, so megatron's
    dtype checks (``param.type() == 'torch.cuda.FloatTensor'``) accept them."""

    @functools.wraps(original)
    def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not self.is_cuda:
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    return tensor_type


def _patch_module(module):
    if getattr(module, "torch", None) is torch:
        module.torch = _CPU_TORCH
    if module.__name__ == "megatron.core.tensor_parallel.random":
        # The RNG tracker forks "the CUDA RNG" through these helpers: fork the CPU one.
        module._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
        module._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
        # With CUDA and CPU RNG being one generator, a fork that draws (dropout) is expected.
        logging.getLogger(module.__name__).addFilter(
            lambda record: "CPU RNG state changed" not in record.getMessage())


class _LazyModulePatcher:
    """Import hook: patches megatron modules that are imported after :func:`install`."""

    def find_spec(self, name, path=None, target=None):
        if not name.startswith(_PREFIX):
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def patched_exec(module):
            exec_module(module)
            _patch_module(module)

        spec.loader.exec_module = patched_exec
        return spec


def install() -> bool:
    """Makes megatron-core run on CPU. Returns True when the bridge is active.

    Idempotent. A no-op (returns False) when CUDA is available.
    """
    global _installed
    if on_cuda():
        return False
    if _installed:
        return True
    quiet_fallback_warnings()
    for message in _CUDA_ONLY_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name, module in list(sys.modules.items()):
        if name.startswith(_PREFIX) and module is not None:
            _patch_module(module)
    sys.meta_path.insert(0, _LazyModulePatcher())
    torch.Tensor.type = _cpu_tensor_type(torch.Tensor.type)
    # megatron moves a few tensors with ``.cuda()``; without CUDA they stay where they are.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    _installed = True
    return True


def installed() -> bool:
    """Whether :func:`install` made megatron-core run on CPU in this process."""
    return _installed


def prepare() -> bool:
    """An entry point's one call before it imports megatron-core: silences megatron-core's
    warnings about missing Transformer Engine and apex and, without CUDA, installs the bridge.
    Returns True when the bridge is active."""
    quiet_fallback_warnings()
    return install()
