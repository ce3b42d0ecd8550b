"""The judge request contract shared by every edge (HTTP, the ZeroMQ client, the service's
endpoints, the config): the shape of a request, its limits, the defaults it is merged with.
Values inside ``sampling_params`` are checked on admission (``SamplingParams.validate``)."""

from __future__ import annotations

import math

from engines.interface import MAX_INT64, short_repr

from .errors import BadMessages

DEFAULT_ROUTE = "__default__"  # the instance of the legacy single-judge flags
SAMPLING_DEFAULTS = {"temperature": 0.1, "top_p": 1.0, "top_k": -1, "max_response_len": 4096}
ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 256
MAX_ROUTE_KEY_CHARS = 256
MAX_TEMPLATE_KWARGS = 16  # chat_template_kwargs entries a request may give
MAX_TEMPLATE_KWARG_CHARS = 256  # length of a string value (or a key) in them
#: apply_chat_template's own parameters and the variables it sets: never from a request
#: (``chat_template`` would run the caller's template source in the service).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template",
        "tools",
        "documents",
        "messages",
        "conversation",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "raise_exception",
        "strftime_now",
    }
)


def check_request(messages, sampling_params, route_key) -> tuple[list, dict | None, str | None]:
    """``messages`` a non-empty list of at most ``MAX_MESSAGES`` ``{role, content}`` objects
    of strings (role system, user or assistant), ``sampling_params`` an object or null (its
    ``chat_template_kwargs``: :func:`check_template_kwargs`), ``route_key`` a short string or
    null. Returns them; raises :class:`BadMessages` or ValueError naming what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise BadMessages("'messages' must be a non-empty list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise BadMessages(f"at most {MAX_MESSAGES} messages")
    for i, message in enumerate(messages):
        if (
            type(message) is not dict
            or message.keys() - {"role", "content"}
            or type(message.get("role")) is not str
            or type(message.get("content")) is not str
        ):
            raise BadMessages(f"messages[{i}] must be an object with string 'role' and 'content' (and nothing else)")
        if message["role"] not in ROLES:
            raise BadMessages(
                f"messages[{i}].role must be system, user or assistant, got {short_repr(message['role'])}"
            )
    if sampling_params is not None and not isinstance(sampling_params, dict):
        raise ValueError("'sampling_params' must be an object")
    if sampling_params:
        check_template_kwargs(sampling_params.get("chat_template_kwargs"))
    if route_key is not None and (not isinstance(route_key, str) or len(route_key) > MAX_ROUTE_KEY_CHARS):
        raise ValueError(
            f"'route_key' must be a string of at most {MAX_ROUTE_KEY_CHARS} characters, got {short_repr(route_key)}"
        )
    return messages, sampling_params, route_key


def check_template_kwargs(value) -> None:
    """A request's ``chat_template_kwargs``: null or at most ``MAX_TEMPLATE_KWARGS`` entries
    of scalar values (null, booleans, 64-bit integers, finite numbers, short strings); never
    template source or ``apply_chat_template``'s own parameters. Raises ValueError."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError(f"chat_template_kwargs must be an object of scalar values, got {short_repr(value)}")
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"chat_template_kwargs: at most {MAX_TEMPLATE_KWARGS} entries, got {len(value)}")
    for key, item in value.items():
        if not isinstance(key, str) or len(key) > MAX_TEMPLATE_KWARG_CHARS:
            raise ValueError(f"chat_template_kwargs: keys must be short strings, got {short_repr(key)}")
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(
                f"chat_template_kwargs.{short_repr(key)} is not allowed: "
                "the judge's chat template and its inputs are set by its configuration"
            )
        if not _scalar(item):
            raise ValueError(
                f"chat_template_kwargs.{short_repr(key)} must be null, a boolean, a finite number or a "
                f"string of at most {MAX_TEMPLATE_KWARG_CHARS} characters, got {short_repr(item)}"
            )


def _scalar(value) -> bool:
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, int):
        return -MAX_INT64 - 1 <= value <= MAX_INT64
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, str) and len(value) <= MAX_TEMPLATE_KWARG_CHARS
