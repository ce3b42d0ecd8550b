"""The built-in torch engine, one responsibility per module:

- :mod:`.engine`: :class:`TorchEngine`, the :class:`engines.interface.Engine` facade (the
  asyncio side and the engine thread's loop).
- :mod:`.stepper`: the engine thread's steps (schedule, run, sample, append; decode steps
  run ahead of the host on CUDA).
- :mod:`.scheduler`: which requests run in a step (admission, preemption, prefix sharing,
  aborts); it decides, it does not run the model.
- :mod:`.block_manager`: the paged KV cache's bookkeeping (free blocks, reference counts,
  rows of the host block table).
- :mod:`.model_runner`: the model, the KV tensors, the prefill and decode forwards, the
  decode CUDA graphs, the self-test after a failed step.
- :mod:`.sampler`: the next token (greedy, seeded, top-k / top-p) and the stop checks.
- :mod:`.weights`: sleep/wake of the weights, their updates by HF name (buckets, CUDA IPC,
  NCCL broadcast) and version.
- :mod:`.sequence`: one request's state; :mod:`.prompts`: a prompt as token ids;
  :mod:`.transfer`: host data to the device without waiting for it.

``import torch`` in these modules is PyTorch: imports are absolute, and this package is
only ever imported as ``engines.builtin``.
"""

from engines.builtin.engine import TorchEngine

__all__ = ["TorchEngine"]
