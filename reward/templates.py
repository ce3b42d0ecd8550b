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
    """The tokenizer's chat template compiled in a sandbox set up as transformers sets up its
    own (trim/lstrip blocks, loop controls, ``tojson``, ``raise_exception``, ``strftime_now``),
    with the variables ``apply_chat_template`` gives it (special tokens, then ``kwargs``).

    Used only where it provably agrees with ``apply_chat_template``: probe conversations are
    rendered both ways at start-up, and any difference (or a template this environment cannot
    compile, such as one with ``{% generation %}`` blocks) gives None: every request then goes
    through ``apply_chat_template``."""
    try:
        template = _sandbox().from_string(tokenizer.get_chat_template())
        variables = _plain_json({**tokenizer.special_tokens_map, **kwargs})
        for conversation in _PROBES:
            fast = template.render(
                messages=conversation, tools=None, documents=None, add_generation_prompt=True, **variables
            )
            general = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **kwargs)
            if fast != general:
                return None
        return template, variables
    except Exception:  # noqa: BLE001 - no fast path; the general one reports real errors
        return None


_PROBES = (
    [{"role": "user", "content": "What is 1 + 1?"}],
    [
        {"role": "system", "content": "Judge strictly."},
        {"role": "user", "content": "x = \\frac{1}{2}"},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "ünïcode \"quoted\" <tag>"},
    ],
)


def _sandbox():
    import json
    from datetime import datetime

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _plain_json(value):
    """``value`` rebuilt from plain JSON types (special tokens may be rich token objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_json(v) for v in value]
    return str(value)


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
