"""A request's prompt as token ids: text, chat messages or ids, checked."""

from __future__ import annotations

#: chat content parts this engine refuses (it runs a VL checkpoint's text model only)
MEDIA_PARTS = ("image", "image_url", "video", "video_url")


def encode_prompt(tokenizer, vocab_size: int, prompt, chat_template_kwargs) -> list:
    """Token ids of a prompt given as text, chat messages (rendered by the chat template) or
    token ids (checked against the vocabulary)."""
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        for m in prompt:  # a VL checkpoint serves its text model: no vision tower
            parts = m.get("content") if isinstance(m, dict) else None
            if isinstance(parts, list) and any(isinstance(p, dict) and p.get("type") in MEDIA_PARTS for p in parts):
                raise ValueError("an image or video content part: this engine serves text only")
        out = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                            **(chat_template_kwargs or {}))
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
        return list(prompt)
    raise ValueError("prompt must be a non-empty list of token ids, a string, or chat messages [{role, content}]")
