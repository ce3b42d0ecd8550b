"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5's hybrid models
(``qwen3_5_moe``: most layers are this, every ``full_attention_interval``-th layer is gated
full attention): the reference path (plain torch on any device, float32 recurrence) and, for
decode on CUDA (or under Triton's interpreter), the Triton kernels of engines/kernels/linear_kernels.py.

A layer keeps, per sequence, a fixed-size state instead of a growing KV cache: the last
``K - 1`` inputs of its short causal convolution (``conv`` [C, K - 1], C the q/k/v channels)
and the delta rule's matrix (``rec`` [Hv, Dk, Dv], float32). For one head, with
``q, k`` L2-normalised (q also scaled by ``Dk ** -0.5``), ``beta = sigmoid(b)`` and the
log-decay ``g = -exp(A_log) * softplus(a + dt_bias)``, each token does

    S = exp(g) * S;   u = beta * (v - S^T k);   S = S + k u^T;   o = S^T q

then ``o`` goes through an RMSNorm gated by ``silu(z)`` and ``out_proj``. Decode runs that
recurrence for one token (:func:`recurrent_step`); prefill runs it chunk by chunk
(:func:`chunked_delta_rule`: inside a chunk the updates are solved at once as a triangular
system, the state carried between chunks). Padding
rows of a prefill take ``beta = 0`` and ``g = 0``: they leave the state as the last real token
left it.

The state lives in the engine's state pool (engines/builtin/state_pool.py), one slot per
running sequence; prefill writes a sequence's slot from scratch (a preempted sequence is
prefilled again from its tokens, which recomputes it), decode reads and writes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.kernels.linear_kernels import conv_decode, recurrent_decode
from engines.kernels.paged_attention import triton_usable

#: chunk length of the chunked delta rule; sequences shorter than it take the power of two
#: that holds them (at least MIN_CHUNK): a chunk's work is quadratic in its length
CHUNK, MIN_CHUNK = 64, 16


def hybrid_fields(d: dict) -> dict:
    """The hybrid-model fields of an HF text config (none for a model without linear
    attention). ``layer_types`` as the config lists it, or every ``full_attention_interval``-th
    layer full attention (HF's default rule)."""
    if "linear_num_value_heads" not in d:
        return {}
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if not types:
        every = d.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown or len(types) != n:
        raise ValueError(f"layer_types {types!r}: expected {n} of 'linear_attention' / 'full_attention'")
    rope = d.get("rope_parameters") or {}
    return {"layer_types": tuple(types), "linear_conv_kernel": d.get("linear_conv_kernel_dim", 4),
            "linear_num_key_heads": d["linear_num_key_heads"], "linear_num_value_heads": d["linear_num_value_heads"],
            "linear_key_head_dim": d["linear_key_head_dim"], "linear_value_head_dim": d["linear_value_head_dim"],
            "partial_rotary_factor": float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))),
            "attn_output_gate": True, "norm_offset": True}


def local_heads(cfg) -> tuple[int, int]:
    """This tensor-parallel rank's (key heads, value heads) of a linear-attention layer: both
    split in contiguous ranges over ``cfg.tp_size`` ranks (a key head's value heads are
    contiguous, so each rank's value heads belong to its own key heads), as SGLang does."""
    tp = getattr(cfg, "tp_size", 1)
    return cfg.linear_num_key_heads // tp, cfg.linear_num_value_heads // tp


def check_shardable(cfg, tp: int) -> None:
    """Raise ValueError naming the head count that does not divide over ``tp`` ranks."""
    for what, n in (("linear-attention key heads", cfg.linear_num_key_heads),
                    ("linear-attention value heads", cfg.linear_num_value_heads)):
        if n % tp:
            raise ValueError(f"{cfg.arch}: {what} ({n}) do not divide over {tp} tensor-parallel GPUs per engine")


def shard_linear_tensor(cfg, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of the full HF tensor ``name`` of a linear-attention layer
    (``...linear_attn.X``): the q, k and v sections of ``in_proj_qkv`` and of the conv's
    channels each by heads, ``in_proj_z`` / ``in_proj_a`` / ``in_proj_b``, ``dt_bias`` and
    ``A_log`` by value heads, ``out_proj`` by input columns (its output is reduced over the
    ranks); the gated norm's weight (one value head's) whole."""
    hk, hv = local_heads(cfg)
    r, dk, dv = cfg.tp_rank, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    leaf = name.rsplit(".", 2)[-2]
    if leaf in ("in_proj_qkv", "conv1d"):
        kd = cfg.linear_num_key_heads * dk
        return torch.cat([tensor.narrow(0, r * hk * dk, hk * dk), tensor.narrow(0, kd + r * hk * dk, hk * dk),
                          tensor.narrow(0, 2 * kd + r * hv * dv, hv * dv)])
    if leaf == "in_proj_z":
        return tensor.narrow(0, r * hv * dv, hv * dv)
    if leaf in ("in_proj_a", "in_proj_b"):
        return tensor.narrow(0, r * hv, hv)
    if name.endswith(("dt_bias", "A_log")):
        return tensor.narrow(0, r * hv, hv)
    if leaf == "out_proj":
        return tensor.narrow(1, r * hv * dv, hv * dv)
    return tensor


def state_shapes(cfg) -> tuple[tuple, tuple]:
    """One sequence's (conv state, recurrent state) shapes in one linear-attention layer (this
    tensor-parallel rank's heads)."""
    hk, hv = local_heads(cfg)
    kd, vd = hk * cfg.linear_key_head_dim, hv * cfg.linear_value_head_dim
    return ((2 * kd + vd, cfg.linear_conv_kernel - 1), (hv, cfg.linear_key_head_dim, cfg.linear_value_head_dim))


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x) * silu(z)`` over the last dimension (one value head)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x.to(dtype) * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer (HF names: ``linear_attn.in_proj_qkv`` ...)."""

    def __init__(self, cfg):
        super().__init__()
        h = cfg.hidden_size
        self.hk, self.hv = local_heads(cfg)  # this tensor-parallel rank's
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel
        channels = 2 * self.hk * self.dk + self.hv * self.dv
        self.in_proj_qkv = nn.Linear(h, channels, bias=False)
        self.in_proj_z = nn.Linear(h, self.hv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(h, self.hv, bias=False)
        self.in_proj_a = nn.Linear(h, self.hv, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, self.kernel, groups=channels, bias=False)  # weight [C, 1, K]
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.hv * self.dv, h, bias=False)

    def _heads(self, mixed: torch.Tensor, x: torch.Tensor):
        """q, k [..., Hv, Dk] (L2-normalised, q scaled; key heads repeated over their value
        heads), v [..., Hv, Dv] (float32), beta and g [..., Hv] (float32) from the conv's output
        ``mixed`` [..., C] and the layer's input ``x``."""
        lead = mixed.shape[:-1]
        kd = self.hk * self.dk
        q, k, v = mixed.float().split([kd, kd, self.hv * self.dv], dim=-1)
        q, k = q.reshape(*lead, self.hk, self.dk), k.reshape(*lead, self.hk, self.dk)
        if self.hv != self.hk:
            q = q.repeat_interleave(self.hv // self.hk, dim=-2)
            k = k.repeat_interleave(self.hv // self.hk, dim=-2)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * self.dk**-0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        beta = torch.sigmoid(self.in_proj_b(x)).float()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        return q, k, v.reshape(*lead, self.hv, self.dv), beta, g

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out_proj`` of the gated norm of ``o`` [..., Hv, Dv] (gate ``z`` from ``x``)."""
        z = self.in_proj_z(x).reshape(*x.shape[:-1], self.hv, self.dv)
        return self.out_proj(self.norm(o.to(x.dtype), z).reshape(*x.shape[:-1], self.hv * self.dv))

    def _conv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The short causal convolution over whole sequences ``x`` [S, L, H] from a zero
        state: (its activated output [S, L, C], its zero-padded input [S, C, K - 1 + L])."""
        mixed = self.in_proj_qkv(x).transpose(1, 2)  # [S, C, L]
        padded = F.pad(mixed, (self.kernel - 1, 0))
        return F.silu(F.conv1d(padded, self.conv1d.weight, groups=mixed.shape[1])).transpose(1, 2), padded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Whole sequences ``x`` [S, L, H] from a zero state, no pool (the trainer's path:
        differentiable; right padding does not reach the real tokens before it)."""
        mixed, _ = self._conv(x)
        q, k, v, beta, g = self._heads(mixed, x)
        return self._out(chunked_delta_rule(q, k, v, beta, g)[0], x)

    def prefill(self, x: torch.Tensor, lens: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor,
                rows: torch.Tensor) -> torch.Tensor:
        """Whole right-padded prompts ``x`` [S, L, H] of lengths ``lens`` [S], none seen
        before: their outputs [S, L, H]; each one's final conv and recurrent state written
        to row ``rows[s]`` of this layer's pool ``conv`` [N, C, K - 1] and ``rec`` [N, Hv, Dk, Dv]."""
        s, length, _ = x.shape
        mixed, padded = self._conv(x)
        # conv state: the last K - 1 inputs of each prompt (zeros before its first token)
        idx = lens[:, None] + torch.arange(self.kernel - 1, device=x.device)  # positions in `padded`
        conv.index_copy_(0, rows, padded.gather(2, idx[:, None, :].expand(-1, padded.shape[1], -1)).to(conv.dtype))
        q, k, v, beta, g = self._heads(mixed, x)
        real = (torch.arange(length, device=x.device)[None, :] < lens[:, None])[..., None]  # [S, L, 1]
        beta, g = beta * real, g * real  # padding: no update, no decay
        o, state = chunked_delta_rule(q, k, v, beta, g)
        rec.index_copy_(0, rows, state.to(rec.dtype))
        return self._out(o, x)

    def decode(self, x: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One token per sequence, ``x`` [B, H]: outputs [B, H]; the states of rows ``rows``
        [B] of ``conv`` and ``rec`` read and advanced by that token. On CUDA (or under
        Triton's interpreter) through the kernels of engines/kernels/linear_kernels.py, which wait on
        nothing (a CUDA graph can hold them); elsewhere the torch reference below."""
        if triton_usable(x.device):
            mixed = conv_decode(self.in_proj_qkv(x), conv, self.conv1d.weight, rows)
            o = recurrent_decode(mixed, self.in_proj_a(x), self.in_proj_b(x), self.A_log, self.dt_bias, rec, rows,
                                 self.hk, self.dk)
            return self._out(o, x)
        return self.decode_reference(x, conv, rec, rows)

    def decode_reference(self, x: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor,
                         rows: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` in plain torch (any device)."""
        mixed = self.in_proj_qkv(x)  # [B, C]
        window = torch.cat([conv.index_select(0, rows), mixed[:, :, None].to(conv.dtype)], dim=2)  # [B, C, K]
        conv.index_copy_(0, rows, window[:, :, 1:])
        mixed = F.silu((window.to(x.dtype) * self.conv1d.weight[:, 0]).sum(-1))
        q, k, v, beta, g = self._heads(mixed, x)
        state = rec.index_select(0, rows).float()
        o, state = recurrent_step(q, k, v, beta, g, state)
        rec.index_copy_(0, rows, state.to(rec.dtype))
        return self._out(o, x)


def recurrent_step(q, k, v, beta, g, state):
    """One token of the gated delta rule for a batch: ``q, k`` [B, H, Dk], ``v`` [B, H, Dv],
    ``beta, g`` [B, H], ``state`` [B, H, Dk, Dv]. Returns (output [B, H, Dv], new state)."""
    state = state * g.exp()[..., None, None]
    u = beta[..., None] * (v - (state * k[..., None]).sum(-2))
    state = state + k[..., None] * u[..., None, :]
    return (state * q[..., None]).sum(-2), state


def chunked_delta_rule(q, k, v, beta, g, chunk: int = CHUNK):
    """The gated delta rule over whole sequences from a zero state, ``CHUNK`` tokens at a
    time: ``q, k`` [S, L, H, Dk], ``v`` [S, L, H, Dv], ``beta, g`` [S, L, H]. Returns
    (outputs [S, L, H, Dv], final states [S, H, Dk, Dv]).

    Inside a chunk with cumulative log-decay ``c_t`` (``G[t, i] = exp(c_t - c_i)``) and state
    ``S0`` before it, the updates ``u`` solve ``(I + A) u = beta * v - beta * exp(c) * K S0``
    with ``A[t, i] = beta_t G[t, i] k_t.k_i`` (i < t); then ``o_t = exp(c_t) q_t S0 +
    sum_{i <= t} G[t, i] (q_t.k_i) u_i`` and the state after the chunk is
    ``exp(c_C) S0 + sum_i exp(c_C - c_i) k_i u_i^T``. Any chunk length gives the same
    result; a sequence shorter than ``chunk`` runs as one chunk of the power of two that holds
    it (the tiny demo's ~30-token rows: 32, not 64)."""
    s, length, h, dk = k.shape
    dv = v.shape[-1]
    chunk = min(chunk, max(MIN_CHUNK, 1 << (max(1, length) - 1).bit_length()))
    pad = -length % chunk
    # [S, H, chunks, chunk, ...]; padded positions have beta = g = 0 (no update, no decay)
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(1, 2).reshape(s, h, -1, chunk, t.shape[-1])
               for t in (q, k, v))
    beta, g = (F.pad(t, (0, 0, 0, pad)).transpose(1, 2).reshape(s, h, -1, chunk) for t in (beta, g))
    c = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # G, zero above the diagonal
    kk = (k @ k.transpose(-1, -2)) * decay * beta[..., None]
    system = kk.tril(-1) + torch.eye(chunk, device=q.device)
    u_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay
    k_out = k * (c[..., -1:] - c).exp()[..., None]  # writes the state after it
    # the first chunk starts from a zero state: its updates are u_v's alone
    u = u_v[:, :, 0]
    outs = [qk[:, :, 0] @ u]
    state = k_out[:, :, 0].transpose(-1, -2) @ u
    chunks = q.shape[2]
    if chunks > 1:  # the later ones read the state before them
        u_s = torch.linalg.solve_triangular(system[:, :, 1:], k[:, :, 1:] * (beta * c.exp())[:, :, 1:, :, None],
                                            upper=False, unitriangular=True)
        q_in = q[:, :, 1:] * c[:, :, 1:].exp()[..., None]
        for i in range(1, chunks):
            u = u_v[:, :, i] - u_s[:, :, i - 1] @ state
            outs.append(q_in[:, :, i - 1] @ state + qk[:, :, i] @ u)
            state = state * c[:, :, i, -1].exp()[..., None, None] + k_out[:, :, i].transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2)  # (a list, not slices written in place: autograd keeps no copy per chunk)
    return out.reshape(s, h, -1, dv)[:, :, :length].transpose(1, 2), state
