"""What the trainer holds on a GPU while it trains, as arithmetic on the model's shape: its
states per parameter, the activations one token keeps for backward, the LM head's logit
chunk. The launcher's plan-time fit (launcher/memory_fit.py) and the trainer's automatic
micro-batch size (:func:`auto_micro_batch_tokens`) both use it.

The per-token figure was measured on an H100 (0.6B shape, bf16: 23.0 GiB peak at 8,192
tokens, 33.6 GiB at 16,384, 62.2 GiB in use at 32,768: about 1.39 MB a token)."""

from __future__ import annotations

#: micro-batch tokens when the trainer has no GPU to size them by (and the old fixed default)
CPU_MICRO_BATCH_TOKENS = 8192
#: the automatic size's bounds (beyond 32,768 tokens the step gains little: the 0.6B shape's
#: forward and backward are compute-bound from about 16,384) and its step
AUTO_MIN_TOKENS, AUTO_MAX_TOKENS, AUTO_STEP_TOKENS = 4096, 32768, 1024
#: the share of the GPU the automatic size may plan for (the rest: the CUDA context, the
#: allocator's fragmentation, the estimate's error)
AUTO_GPU_SHARE = 0.8


def sized_to_the_gpu(moe: bool, hybrid: bool) -> bool:
    """Whether an unset micro-batch size is sized to the GPU (:func:`auto_micro_batch_tokens`)
    for such a model: not for MoE and hybrid (linear-attention) models, whose activations the
    per-token arithmetic was not measured on (they keep CPU_MICRO_BATCH_TOKENS)."""
    return not (moe or hybrid)


def state_bytes_per_param(bf16: bool, dp: int) -> float:
    """bf16: param 2 + fp32 grad buffer 4 + fp32 master and Adam moments 12 over DP (the
    distributed optimizer); fp32: param 4 + grad 4 + Adam moments 8."""
    return (2 + 4 + 12 / max(1, dp)) if bf16 else 16.0


def activation_bytes_per_token(hidden: int, intermediate: int, layers: int, tp: int, bf16: bool,
                               full_recompute: bool = False) -> float:
    """Kept for backward per token, all layers (fused attention: nothing S x S; the fused
    norms, RoPE and SwiGLU keep their inputs only): per layer ~13 hidden-sized values (norm
    inputs and outputs, q / k / v before and after their norms, the attention output) and ~4
    MLP-sized ones (fc1's two halves, SwiGLU's output, slack). Full recompute keeps each
    layer's input and one layer's activations."""
    act = 2 if bf16 else 4
    per_layer = act * (13 * hidden + 4 * intermediate) / tp
    if full_recompute:
        return layers * act * hidden + per_layer
    return layers * per_layer


def logit_bytes(tokens: int, vocab: int, hidden: int, tp: int, bf16: bool) -> float:
    """The fused LM head's chunk of logits in the weights' dtype (two in backward: the chunk
    projected again, then its gradient in place) and, over several chunks, a float32
    accumulator of the head's gradient."""
    from engines.kernels.token_logprobs import ROWS  # the chunk's rows

    act = 2 if bf16 else 4
    out = 2 * min(tokens, ROWS) * vocab / tp * act
    if tokens > ROWS:
        out += vocab * hidden / tp * 4
    return out


def auto_micro_batch_tokens(total: int, params: int, *, hidden: int, intermediate: int, layers: int, vocab: int,
                            tp: int = 1, dp: int = 1, bf16: bool = True, full_recompute: bool = False,
                            beside: float = 0) -> int:
    """The largest micro-batch (padded tokens per forward and backward, a multiple of
    AUTO_STEP_TOKENS within [AUTO_MIN_TOKENS, AUTO_MAX_TOKENS]) whose activations and logit
    chunk fit, beside the states of ``params`` parameters (this rank's) and ``beside`` bytes
    more (a reference model's weights), in AUTO_GPU_SHARE of a GPU of ``total`` bytes.
    AUTO_MIN_TOKENS when even that does not fit (the plan-time fit says so before anything
    starts)."""
    room = AUTO_GPU_SHARE * total - params * state_bytes_per_param(bf16, dp) - beside
    per_token = activation_bytes_per_token(hidden, intermediate, layers, tp, bf16, full_recompute)
    tokens = AUTO_MAX_TOKENS
    while tokens > AUTO_MIN_TOKENS and tokens * per_token + logit_bytes(tokens, vocab, hidden, tp, bf16) > room:
        tokens -= AUTO_STEP_TOKENS
    return tokens
