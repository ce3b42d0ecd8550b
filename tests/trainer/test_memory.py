"""The trainer's memory arithmetic (engines/trainer/memory.py): it agrees with the peaks
measured on an H100, and the automatic micro-batch size is the most tokens that fit the
share of the GPU it plans for, within its bounds."""

from __future__ import annotations

import pytest

from engines.trainer import memory

pytestmark = pytest.mark.unit
GIB = 1 << 30
#: Qwen3-0.6B's and Qwen3-4B's shapes and parameter counts (tied embeddings)
Q06 = dict(hidden=1024, intermediate=3072, layers=28, vocab=151936)
Q06_PARAMS = 596_049_920
Q4 = dict(hidden=2560, intermediate=9728, layers=36, vocab=151936)
Q4_PARAMS = 4_022_468_096


def need(tokens: int, params: int, shape: dict, dp: int = 1, full_recompute: bool = False, beside: float = 0):
    """Bytes the arithmetic plans for: states + activations + the logit chunk (+ beside)."""
    return (params * memory.state_bytes_per_param(True, dp) + beside
            + tokens * memory.activation_bytes_per_token(shape["hidden"], shape["intermediate"], shape["layers"], 1,
                                                         True, full_recompute)
            + memory.logit_bytes(tokens, shape["vocab"], shape["hidden"], 1, True))


@pytest.mark.parametrize("tokens, measured_gib", [(8192, 23.0), (16384, 33.6)])
def test_the_estimate_is_within_ten_percent_of_the_h100_peaks(tokens, measured_gib):
    """0.6B shape, bf16, one GPU: the torch peaks of a train step measured on an H100."""
    estimate = need(tokens, Q06_PARAMS, Q06) / GIB
    assert abs(estimate - measured_gib) <= 0.1 * measured_gib, (tokens, estimate, measured_gib)


@pytest.mark.parametrize("params, shape", [(Q06_PARAMS, Q06), (Q4_PARAMS, Q4)])
@pytest.mark.parametrize("gib", [16, 24, 40, 48, 80, 141])
@pytest.mark.parametrize("dp, full_recompute, beside",
                         [(1, False, 0), (8, False, 0), (1, True, 0), (1, False, 8 * GIB)])
def test_the_automatic_micro_batch_is_the_most_tokens_that_fit(params, shape, gib, dp, full_recompute, beside):
    total = gib * GIB
    tokens = memory.auto_micro_batch_tokens(total, params, **shape, dp=dp, full_recompute=full_recompute,
                                            beside=beside)
    assert memory.AUTO_MIN_TOKENS <= tokens <= memory.AUTO_MAX_TOKENS
    assert tokens % memory.AUTO_STEP_TOKENS == 0
    room = memory.AUTO_GPU_SHARE * total
    fits = lambda n: need(n, params, shape, dp, full_recompute, beside) <= room  # noqa: E731
    if tokens > memory.AUTO_MIN_TOKENS:
        assert fits(tokens), tokens
    if tokens < memory.AUTO_MAX_TOKENS:
        assert not fits(tokens + memory.AUTO_STEP_TOKENS), tokens


def test_more_memory_never_gives_fewer_tokens_and_what_shares_the_gpu_gives_fewer():
    sizes = [memory.auto_micro_batch_tokens(gib * GIB, Q06_PARAMS, **Q06) for gib in range(8, 160, 4)]
    assert sizes == sorted(sizes) and sizes[0] == memory.AUTO_MIN_TOKENS and sizes[-1] == memory.AUTO_MAX_TOKENS
    alone = memory.auto_micro_batch_tokens(40 * GIB, Q06_PARAMS, **Q06)
    with_reference = memory.auto_micro_batch_tokens(40 * GIB, Q06_PARAMS, **Q06, beside=4 * GIB)
    assert with_reference < alone


def test_the_lent_gpus_get_the_sizes_their_runs_used():
    """An H100 (79.1 GiB as torch reports it) takes the 0.6B shape's 32,768-token micro-batches
    (62 GiB in use, measured); an H200 (139.8 GiB) takes the 4B shape's 8,192 (its step at 1 x
    8,192 peaked at about 104 GB, measured)."""
    assert memory.auto_micro_batch_tokens(int(79.1 * GIB), Q06_PARAMS, **Q06) == 32768
    assert memory.auto_micro_batch_tokens(int(139.8 * GIB), Q4_PARAMS, **Q4) == 8192
