"""The small shims megatron-core needs on CPU/gloo (docs/trainer.md).

``install()`` is a no-op when CUDA is available. On CPU it makes
``torch.cuda.current_device()`` return the CPU device (Megatron calls it in ~175 places)
and points Megatron's model-parallel RNG tracker at the CPU generator, so the seeding and
the dropout RNG forks work (and, on every device, lets Megatron's MoE router run without
TransformerEngine: :func:`moe_without_te`). Megatron's optimizer and DDP wrapper also hard-code
``device='cuda'``; calls into them run under :func:`megatron_cuda_calls` (a
``TorchFunctionMode`` on CPU, nothing on CUDA).
"""

from __future__ import annotations

import logging
import threading

import torch

_installed = False
_IMPORT_LOCK = threading.Lock()


def quiet_optional_backend_warnings() -> None:
    """Megatron warns at import that TransformerEngine/Apex are absent (they are optional
    here) once per module and process; keep job logs readable."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated")


def import_megatron_without_jit_fuser() -> None:
    """Import megatron-core with its JIT fuser off, as ``megatron.core.jit.disable_jit_fuser()``
    would if it could run first: Megatron decorates its fused elementwise helpers with
    ``jit_fuser`` (``torch.compile``) when their modules are imported, and that call alone
    imports TorchDynamo and Inductor (1.2 s of the 1.9 s megatron-core takes to import, in every
    trainer process). The trainer turns those fusions off in its TransformerConfig, and
    whichever helper still runs computes the same values eagerly (no compile at its first call
    either). ``torch.compile`` is itself again on return. Thread-safe: two trainers set up at
    once in one process (the policy and its reference) wait for one import."""
    import sys

    with _IMPORT_LOCK:
        if "megatron.core" in sys.modules:
            return
        compile_ = torch.compile

        def decorate_only(model=None, **_):
            return model if model is not None else (lambda fn: fn)

        torch.compile = decorate_only
        try:
            import megatron.core  # noqa: F401 (its package imports the fused helpers)
            from megatron.core import jit

            jit.disable_jit_fuser()
        finally:
            torch.compile = compile_


def moe_without_te() -> None:
    """megatron-core 0.16's router (``moe_utils.RouterGatingLinearFunction``) tests
    ``te_general_gemm is not None``, a name its module defines only when TransformerEngine
    imports: without TE every MoE forward raises NameError. Define it as None there (the
    torch.mm path is then taken). Needed on CUDA without TE too."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def install() -> None:
    global _installed
    quiet_optional_backend_warnings()
    import_megatron_without_jit_fuser()
    moe_without_te()
    if _installed or torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    _installed = True


class CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Megatron's optimizer and DDP code create tensors with literal ``device='cuda'`` (53
    sites), call ``.cuda()`` and check ``.type() == 'torch.cuda.FloatTensor'``. On CPU, run
    them inside this mode: ``device='cuda'`` becomes cpu, ``.cuda()`` is the identity and
    ``.type()`` reports the CUDA name. A no-op context on CUDA (see :func:`megatron_cuda_calls`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        if dev is not None and "cuda" in str(dev):
            kwargs["device"] = "cpu"
        name = getattr(func, "__name__", "")
        if name == "cuda" and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "type" and len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def megatron_cuda_calls():
    """Context for calls into Megatron's optimizer/DDP: :class:`CudaToCpuMode` on CPU,
    nothing on CUDA."""
    import contextlib

    return contextlib.nullcontext() if torch.cuda.is_available() else CudaToCpuMode()
