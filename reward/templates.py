"""Chat templates in the judge service: messages -> the prompt text its engines tokenize.

Client input is data here: a request gives messages and, at most, scalar
``chat_template_kwargs`` that the instance's template reads (:func:`request_template_kwargs`);
the template itself is the judge model's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.interface import short_repr

from .protocol import RESERVED_TEMPLATE_KWARGS, check_template_kwargs

INLINE_RENDER_CHARS = 1 << 16  # requests with more message text are rendered off the event loop
MAX_RENDERED_CHARS = 4 << 20  # a rendered prompt longer than this is refused


@dataclass(frozen=True)
class ChatTemplate:
    """One judge instance's template: its tokenizer, its configured ``chat_template_kwargs``,
    the compiled template with the variables ``apply_chat_template`` would give it (None:
    always go through ``apply_chat_template``), and the variables the template reads."""

    tokenizer: object
    kwargs: dict
    compiled: tuple | None
    reads: frozenset

    @classmethod
    def of(cls, tokenizer, kwargs: dict) -> ChatTemplate:
        compiled = _compiled_template(tokenizer, kwargs)
        reads = _template_reads(tokenizer, compiled) - RESERVED_TEMPLATE_KWARGS - set(tokenizer.special_tokens_map)
        return cls(tokenizer, kwargs, compiled, reads)

    def request_kwargs(self, value) -> dict:
        """The template kwargs for a request giving ``value``: the configured dict itself
        when the request adds nothing the template reads (requests sharing it render
        together), else a merged copy. Entries the template does not read are dropped; the
        tokenizer's special tokens cannot be overridden (ValueError)."""
        check_template_kwargs(value)
        if not value:
            return self.kwargs
        special = [k for k in value if k in self.tokenizer.special_tokens_map]
        if special:
            raise ValueError(f"chat_template_kwargs.{short_repr(special[0])} is not allowed: the tokenizer sets it")
        given = {k: v for k, v in value.items() if k in self.reads}
        return {**self.kwargs, **given} if given else self.kwargs

    def render(self, conversations: list, kwargs: dict) -> list[str]:
        """Prompt texts of ``conversations`` (the engines tokenize them:
        ``EngineActor.generate_rendered``). With the configured kwargs, plain {role, content}
        messages are rendered by the compiled template directly, exactly as
        ``apply_chat_template`` renders them (it normalizes messages to these plain dicts,
        then calls the same compiled template with the same variables), without its per-call
        wrapper; anything else goes through ``apply_chat_template``. A prompt over
        ``MAX_RENDERED_CHARS`` is refused (ValueError)."""
        if self.compiled is not None and kwargs is self.kwargs and all(_plain_chat(c) for c in conversations):
            template, variables = self.compiled
            texts = [
                template.render(messages=c, tools=None, documents=None, add_generation_prompt=True, **variables)
                for c in conversations
            ]
        else:
            texts = self.tokenizer.apply_chat_template(
                conversations, add_generation_prompt=True, tokenize=False, **kwargs
            )
        if not isinstance(texts, list) or len(texts) != len(conversations):  # a conversation was not a list
            raise TypeError("messages must be a list of {role, content} objects")
        for text in texts:
            if len(text) > MAX_RENDERED_CHARS:
                raise ValueError(f"the rendered prompt has {len(text)} characters; at most {MAX_RENDERED_CHARS}")
        return texts


def message_chars(conversations: list) -> int:
    """Characters of message content in ``conversations`` (malformed parts count 0)."""
    return sum(
        len(m["content"])
        for c in conversations
        if isinstance(c, list)
        for m in c
        if isinstance(m, dict) and isinstance(m.get("content"), str)
    )


def _compiled_template(tokenizer, kwargs: dict) -> tuple | None:
    """The tokenizer's chat template compiled by transformers, with the variables
    ``apply_chat_template`` would give it (special tokens, then ``kwargs``); None when this
    transformers does not offer them or the template cannot be had."""
    try:
        from transformers.utils.chat_template_utils import (
            _compile_jinja_template,
            _plain_template_data,
        )

        return _compile_jinja_template(tokenizer.get_chat_template()), _plain_template_data(
            {**tokenizer.special_tokens_map, **kwargs}
        )
    except Exception:  # noqa: BLE001 - no fast path; the general one reports real errors
        return None


def _template_reads(tokenizer, compiled: tuple | None) -> frozenset:
    """The undeclared variables of the tokenizer's chat template (what it reads from its
    caller), parsed with the environment transformers compiles it in."""
    try:
        import jinja2
        from jinja2 import meta

        env = (
            compiled[0].environment
            if compiled is not None
            else jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        )
        return frozenset(meta.find_undeclared_variables(env.parse(tokenizer.get_chat_template())))
    except Exception:  # noqa: BLE001 - no template or unparsable: a request may set none
        return frozenset()


def _plain_chat(messages) -> bool:
    """Messages that transformers' normalization leaves as they are: dicts of str role/content."""
    return type(messages) is list and all(
        type(m) is dict and m.keys() <= {"role", "content"} and all(type(v) is str for v in m.values())
        for m in messages
    )
