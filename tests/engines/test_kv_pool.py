"""engines/kv_pool.py: KV tensors lent by a sleeping engine, taken whole by the next."""

from __future__ import annotations

import torch

from engines import kv_pool


def test_a_lent_tensor_is_taken_once_by_the_smallest_fit_and_drain_frees_the_rest():
    kv_pool.drain()
    big, small = torch.zeros(1000), torch.zeros(100)
    kv_pool.lend("cpu", [big, small, None])
    assert kv_pool.lent_bytes("cpu") == 1100 * 4
    k = kv_pool.take("cpu", (10, 9), torch.float32)  # 360 bytes: the small one fits
    assert k.shape == (10, 9) and k.untyped_storage().data_ptr() == small.untyped_storage().data_ptr()
    assert kv_pool.take("cpu", (2000,), torch.float32) is None  # nothing that large
    v = kv_pool.take("cpu", (500,), torch.bfloat16)  # another dtype over the same memory
    assert v.dtype == torch.bfloat16 and v.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
    assert kv_pool.lent_bytes("cpu") == 0 and kv_pool.take("cpu", (1,), torch.float32) is None
    kv_pool.lend("cpu", [torch.zeros(8)])
    assert kv_pool.drain("cpu") == 32 and kv_pool.lent_bytes("cpu") == 0


def test_a_colocated_built_in_engine_lends_its_kv_cache():
    """The launcher's offload (a colocated engine) becomes lend_kv for the built-in engine;
    SGLang gets it as is."""
    from engines.interface import backend_options

    assert backend_options("torch", {"offload": True})["lend_kv"] is True
    assert "lend_kv" not in backend_options("torch", {"offload": False})
    assert backend_options("sglang", {"offload": True}) == {"offload": True}
