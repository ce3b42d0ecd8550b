"""The judge request contract shared by every edge (HTTP, the ZeroMQ client, the service's
endpoints, the config): the shape of a request, its limits, the defaults it is merged with.
Values inside ``sampling_params`` are checked on admission (``SamplingParams.validate``)."""

from __future__ import annotations

import math

from engines.interface import MAX_INT64, short_repr

from .errors import BadMessages, TextOnly

DEFAULT_ROUTE = "__default__"  # the instance of the legacy single-judge flags
SAMPLING_DEFAULTS = {"temperature": 0.1, "top_p": 1.0, "top_k": -1, "max_response_len": 4096}
MAX_MESSAGES = 256
MAX_ROLE_CHARS = 64  # any role the judge's chat template accepts (system, user, assistant, tool, ...)
MAX_CONTENT_PARTS = 64  # OpenAI-style content parts of one message
TEXT_PART_JOIN = "\n"  # the text parts of one message are joined with this
#: content part types of images and videos (OpenAI's, and those of VL chat templates): refused with TextOnly
MEDIA_PARTS = frozenset({"image", "image_url", "video", "video_url"})
MAX_PROMPT_CHARS = 4 << 20  # a native payload's ``text``
MAX_INPUT_IDS = 1 << 18  # a native payload's ``input_ids``
MAX_TOKEN_ID = 2**31 - 1  # above: never a token id (the instance's vocabulary is checked too)
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


def check_unicode(value, name: str) -> None:
    """Every string in ``value`` (keys included, nested in lists and objects) is valid Unicode:
    a lone surrogate (``"\\ud800"`` in JSON) cannot be encoded as UTF-8, so it cannot travel
    to an engine and would fail every request batched with it. ValueError naming where."""
    stack = [(name, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise ValueError(f"{where} holds a lone surrogate (U+{ord(v[e.start]):04X} at character "
                                     f"{e.start}): text must be valid Unicode") from None
        elif isinstance(v, dict):
            for k, item in v.items():
                stack.append((f"{where} key", k))
                stack.append((f"{where}.{k}" if isinstance(k, str) and k.isascii() else f"{where}[...]", item))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(v))


def check_request(messages, sampling_params, route_key) -> tuple[list, dict | None, str | None]:
    """``messages`` a non-empty list of at most ``MAX_MESSAGES`` ``{role, content}`` objects:
    ``role`` a string of 1 to ``MAX_ROLE_CHARS`` characters (the chat template decides which
    roles it knows), ``content`` a string or a list of at most ``MAX_CONTENT_PARTS`` OpenAI
    text parts ``{"type": "text", "text": str}`` (joined with ``TEXT_PART_JOIN``; an image or
    video part is :class:`TextOnly`, HTTP 400; any other part type is refused: only text is
    supported); ``sampling_params`` an object or null (its
    ``chat_template_kwargs``: :func:`check_template_kwargs`), ``route_key`` a short string or
    null. Returns them, the messages with plain string contents (a copy where parts were
    joined); raises :class:`BadMessages`, :class:`TextOnly` or ValueError naming what is
    wrong."""
    if not isinstance(messages, list) or not messages:
        raise BadMessages("'messages' must be a non-empty list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise BadMessages(f"at most {MAX_MESSAGES} messages")
    check_unicode(messages, "messages")
    joined = None
    for i, message in enumerate(messages):
        if type(message) is not dict or message.keys() - {"role", "content"} or type(message.get("role")) is not str:
            raise BadMessages(f"messages[{i}] must be an object with string 'role' and 'content' (and nothing else)")
        if not 1 <= len(message["role"]) <= MAX_ROLE_CHARS:
            raise BadMessages(
                f"messages[{i}].role must be a string of 1 to {MAX_ROLE_CHARS} characters, "
                f"got {short_repr(message['role'])}"
            )
        content = message.get("content")
        if type(content) is str:
            continue
        text = _text_of_parts(i, content)
        if joined is None:
            joined = list(messages)
        joined[i] = {"role": message["role"], "content": text}
    check_sampling_and_route(sampling_params, route_key)
    return (joined if joined is not None else messages), sampling_params, route_key


def _text_of_parts(i: int, content) -> str:
    if type(content) is not list or not content:
        raise BadMessages(
            f"messages[{i}].content must be a string or a non-empty list of "
            '{"type": "text", "text": ...} parts, got ' + short_repr(content)
        )
    if len(content) > MAX_CONTENT_PARTS:
        raise BadMessages(f"messages[{i}].content: at most {MAX_CONTENT_PARTS} parts, got {len(content)}")
    texts = []
    for j, part in enumerate(content):
        if type(part) is not dict or type(part.get("type")) is not str:
            raise BadMessages(f"messages[{i}].content[{j}] must be an object with a 'type', got {short_repr(part)}")
        if part["type"] in MEDIA_PARTS:
            raise TextOnly(
                f"messages[{i}].content[{j}] has type {part['type']!r}: this backend serves text only (images and "
                'videos are not supported; send {"type": "text", "text": "..."} parts or a string)'
            )
        if part["type"] != "text":
            raise BadMessages(
                f"messages[{i}].content[{j}] has type {short_repr(part['type'])}: only text is supported "
                '(parts {"type": "text", "text": "..."})'
            )
        if part.keys() - {"type", "text"} or type(part.get("text")) is not str:
            raise BadMessages(
                f'messages[{i}].content[{j}] must be {{"type": "text", "text": <string>}} (and nothing else)'
            )
        texts.append(part["text"])
    return TEXT_PART_JOIN.join(texts)


def check_sampling_and_route(sampling_params, route_key) -> None:
    """``sampling_params`` an object or null (its values are checked on admission by
    ``SamplingParams``; its ``chat_template_kwargs`` here), ``route_key`` a short string or
    null. Raises ValueError."""
    if sampling_params is not None and not isinstance(sampling_params, dict):
        raise ValueError("'sampling_params' must be an object")
    check_unicode(sampling_params, "sampling_params")
    check_unicode(route_key, "route_key")
    if sampling_params:
        check_template_kwargs(sampling_params.get("chat_template_kwargs"))
    if route_key is not None and (not isinstance(route_key, str) or len(route_key) > MAX_ROUTE_KEY_CHARS):
        raise ValueError(
            f"'route_key' must be a string of at most {MAX_ROUTE_KEY_CHARS} characters, got {short_repr(route_key)}"
        )


def check_native(text, input_ids, sampling_params, route_key) -> tuple[str | list, dict | None, str | None]:
    """An SGLang-native payload (no chat template): exactly one of ``text`` (a string of 1
    to ``MAX_PROMPT_CHARS`` characters) and ``input_ids`` (a non-empty list of at most
    ``MAX_INPUT_IDS`` integers in [0, ``MAX_TOKEN_ID``]; the judge instance also checks them
    against its vocabulary), with ``sampling_params`` and ``route_key`` as for chat requests.
    Returns (prompt, sampling_params, route_key); raises ValueError naming what is wrong."""
    if (text is None) == (input_ids is None):
        raise ValueError("a native payload needs exactly one of 'text' (a prompt string) and 'input_ids'")
    if text is not None:
        if type(text) is not str or not 1 <= len(text) <= MAX_PROMPT_CHARS:
            raise ValueError(f"'text' must be a string of 1 to {MAX_PROMPT_CHARS} characters, got {short_repr(text)}")
        check_unicode(text, "text")
        prompt: str | list = text
    else:
        if type(input_ids) is not list or not 1 <= len(input_ids) <= MAX_INPUT_IDS:
            raise ValueError(
                f"'input_ids' must be a list of 1 to {MAX_INPUT_IDS} token ids, got {short_repr(input_ids)}"
            )
        for k, t in enumerate(input_ids):
            if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
                raise ValueError(f"input_ids[{k}] must be a token id (an integer >= 0), got {short_repr(t)}")
        prompt = input_ids
    check_sampling_and_route(sampling_params, route_key)
    return prompt, sampling_params, route_key


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


def health_body(instances: dict) -> dict:
    """The original's health shape from :meth:`JudgeService.health`'s per-instance entries:
    ``{"status", "service": "genrm"}``, with several instances ``"instances"``; one instance's
    ``sleeping`` / ``degraded`` at the top level; an ``"error"`` naming what is unhealthy."""
    healthy = all(v["status"] == "healthy" for v in instances.values())
    out: dict = {"status": "healthy" if healthy else "unhealthy", "service": "genrm"}
    if len(instances) > 1:
        out["instances"] = instances  # each asleep one has "sleeping": true
    else:
        (only,) = instances.values()
        if only.get("sleeping"):
            out["sleeping"] = True  # the legacy single-instance shape: why generate answers 503
        if only.get("degraded"):  # serving on fewer engines while a dead one is rebuilt
            out.update(degraded=True, engines_working=only["engines_working"], engines=only["engines"])
    if not healthy:
        out["error"] = "; ".join(
            f"{k}: {v.get('error', v['status'])}" for k, v in instances.items() if v["status"] != "healthy"
        )
    return out


def metrics_body(snapshot: dict) -> dict:
    """The original's metrics shape from :meth:`JudgeService.metrics_snapshot`: one instance
    flat, ``{"service": "genrm", "model_path", "num_gpus", "num_engines", <counters>}``;
    several under ``"instances": {route_key: {...}}``."""
    if len(snapshot) == 1:
        (only,) = snapshot.values()
        return {"service": "genrm", **only}
    return {"service": "genrm", "instances": snapshot}
