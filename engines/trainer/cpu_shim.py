"""The small shims megatron-core needs on CPU/gloo (see reference cpu-feasibility.md).

``install()`` is a no-op when CUDA is available. On CPU it makes
``torch.cuda.current_device()`` return the CPU device (Megatron calls it in ~175 places)
and points Megatron's model-parallel RNG tracker at the CPU generator, so the seeding and
the dropout RNG forks work. Optimizer-specific ``device='cuda'`` literals are handled where
the optimizer is built (later), not here.
"""

from __future__ import annotations

import logging

import torch

_installed = False


def quiet_optional_backend_warnings() -> None:
    """Megatron warns at import that TransformerEngine/Apex are absent (they are optional
    here) once per module and process; keep job logs readable."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated")


def install() -> None:
    global _installed
    quiet_optional_backend_warnings()
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
