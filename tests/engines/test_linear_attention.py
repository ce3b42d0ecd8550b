"""The chunked gated delta rule (engines/models/linear_attention.py) against the token-by-token
recurrence it reformulates: outputs and final states over lengths that fill no chunk, one,
several and a part of one, for the default chunk and others; and the gradient does not depend
on the chunk length (short sequences take a shorter chunk than the default)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines.models.linear_attention import chunked_delta_rule, recurrent_step

pytestmark = pytest.mark.unit


def inputs(s: int, length: int, h: int = 3, dk: int = 8, dv: int = 5, seed: int = 0, decay: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(s, length, h, dk, generator=gen, dtype=torch.float64), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(s, length, h, dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(s, length, h, dv, generator=gen, dtype=torch.float64)
    beta = torch.rand(s, length, h, generator=gen, dtype=torch.float64)
    g = -torch.rand(s, length, h, generator=gen, dtype=torch.float64) * decay
    return q, k, v, beta, g


def recurrence(q, k, v, beta, g):
    s, length, h, dk = k.shape
    state = torch.zeros(s, h, dk, v.shape[-1], dtype=v.dtype)
    outs = []
    for t in range(length):
        o, state = recurrent_step(q[:, t], k[:, t], v[:, t], beta[:, t], g[:, t], state)
        outs.append(o)
    return torch.stack(outs, dim=1), state


@pytest.mark.parametrize("length", [1, 5, 16, 28, 33, 64, 65, 130])
@pytest.mark.parametrize("chunk", [16, 64])
def test_the_chunked_rule_equals_the_recurrence(length, chunk):
    args = inputs(2, length, decay=4.0 if length > 60 else 1.0)
    out, state = chunked_delta_rule(*args, chunk=chunk)
    want_out, want_state = recurrence(*args)
    assert out.shape == want_out.shape and state.shape == want_state.shape
    torch.testing.assert_close(out, want_out, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(state, want_state, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("length", [7, 28, 100])
def test_the_gradient_does_not_depend_on_the_chunk_length(length):
    grads = []
    for chunk in (16, 32, 64):
        args = [t.clone().requires_grad_() for t in inputs(3, length, seed=1)]
        out, state = chunked_delta_rule(*args, chunk=chunk)
        (out.square().sum() + (state * 0.5).sum()).backward()
        grads.append([a.grad for a in args])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
