"""The gateway's OpenAI-compatible routes, for OpenAI clients (``base_url =
http://HOST:PORT/genrm/v1``):

- ``GET /genrm/v1/models``: one model per judge instance; its ``id`` is the instance's route
  key (``"__default__"`` for the legacy single instance), ``root`` its model path.
- ``POST /genrm/v1/chat/completions`` (also ``/genrm/chat/completions``): ``model`` names the
  instance (its route key, or its model path when exactly one instance serves that path);
  ``messages`` as for ``/genrm/generate`` (checked by :func:`reward.protocol.check_request`);
  ``temperature``, ``top_p``, ``max_tokens`` (or ``max_completion_tokens``), ``stop``,
  ``seed`` map to the judge's sampling, SGLang's extra keys (``top_k``, ``min_p``, penalties,
  ...) pass through to it; ``n`` completions are ``n`` judge requests. The answer is an
  OpenAI ``chat.completion`` with ``usage`` token counts. No streaming.

Errors are OpenAI error objects ``{"error": {"message", "type", "param", "code"}}``; an
unknown model is 404 ``model_not_found``.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from engines.interface import short_repr

from .errors import BadMessages
from .http_messages import Request, Response
from .protocol import check_request

MAX_CHOICES = 16  # n
# OpenAI request keys and the judge's sampling key each maps to
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "stop": "stop",
    "seed": "seed",
    # SGLang's extensions of its OpenAI API, passed through to the judge's sampling
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "min_tokens": "min_new_tokens",
    "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "no_stop_trim",
    "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids",
}
# keys accepted and ignored when they ask for nothing we would do differently
IGNORED = {"user": None, "stream": False, "logprobs": False, "parallel_tool_calls": None, "store": False}
FINISH_REASONS = {"stop": "stop", "length": "length"}


def openai_error(message: str, status: int, param: str | None = None, code: str | None = None, headers=None):
    kind = {
        401: "authentication_error",
        404: "invalid_request_error",
        429: "rate_limit_error",
    }.get(status, "invalid_request_error" if status < 500 else "server_error")
    return Response.json({"error": {"message": message, "type": kind, "param": param, "code": code}}, status, headers)


def completion_request(body, resolve) -> tuple[str, list, dict, int]:
    """(route key, messages, sampling_params, n) of a chat completion body, or ValueError
    (:class:`BadMessages` for its messages; ``LookupError`` for an unknown model).
    ``resolve(model)`` gives the route key of a model name or raises LookupError."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object with 'model' and 'messages'")
    model = body.get("model")
    if not isinstance(model, str):
        raise ValueError(f"'model' must be a string naming a judge instance, got {short_repr(model)}")
    route_key = resolve(model)
    sampling: dict = {}
    n = 1
    for key, value in body.items():
        if key in ("model", "messages"):
            continue
        if key == "n":
            if type(value) is not int or not 1 <= value <= MAX_CHOICES:
                raise ValueError(f"'n' must be an integer in [1, {MAX_CHOICES}], got {short_repr(value)}")
            n = value
        elif key == "chat_template_kwargs":
            sampling[key] = value
        elif key in SAMPLING_KEYS:
            if value is not None:  # OpenAI clients send null for "not given"
                sampling[SAMPLING_KEYS[key]] = value
        elif key in IGNORED:
            if value not in (None, IGNORED[key]) and not (key == "user" and isinstance(value, str)):
                raise ValueError(f"{key}={short_repr(value)} is not supported by the judge")
        else:
            raise ValueError(
                f"unknown or unsupported field {short_repr(key)}; supported: model, messages, n, "
                f"chat_template_kwargs, {', '.join(SAMPLING_KEYS)}"
            )
    messages = check_request(body.get("messages"), sampling or None, route_key)[0]
    return route_key, messages, sampling, n


class OpenAIRoutes:
    """The OpenAI-compatible handlers of a :class:`reward.gateway.Gateway`."""

    def __init__(self, gateway):
        self.gateway = gateway

    async def _instances(self) -> dict:
        return await self.gateway.service.metrics_snapshot()

    async def models(self, request: Request) -> Response:
        created = int(self.gateway.started)
        data = [
            {"id": key, "object": "model", "created": created, "owned_by": "genrm", "root": info["model_path"]}
            for key, info in (await self._instances()).items()
        ]
        return Response.json({"object": "list", "data": data})

    async def chat_completions(self, request: Request) -> Response:
        gateway = self.gateway
        body, refused = gateway.read_json(request)
        if refused is not None:
            return openai_error(refused[1], refused[0])
        instances = await self._instances()

        def resolve(model: str) -> str:
            if model in instances:
                return model
            by_path = [key for key, info in instances.items() if info["model_path"] == model]
            if len(by_path) == 1:
                return by_path[0]
            raise LookupError(
                f"The model {short_repr(model)} does not exist: this judge serves {sorted(instances)} "
                "(GET /genrm/v1/models)"
            )

        try:
            route_key, messages, sampling, n = completion_request(body, resolve)
        except LookupError as e:
            gateway._count("invalid_request")
            return openai_error(str(e), 404, "model", "model_not_found")
        except ValueError as e:
            gateway._count("invalid_request")
            status = 422 if isinstance(e, BadMessages) else 400
            return openai_error(f"Invalid request body: {e}", status, "messages" if status == 422 else None)
        submit = gateway.service.submit

        def choice(k: int) -> dict | None:  # with a seed, choice k samples with seed + k (else n equal choices)
            if n > 1 and type(sampling.get("seed")) is int:
                return {**sampling, "seed": (sampling["seed"] + k) % (1 << 63)}
            return sampling or None

        outcomes = await asyncio.gather(
            *(
                gateway.outcome(lambda k=k: submit(messages, choice(k), route_key, checked=True, detail=True))
                for k in range(n)
            )
        )
        failed = next((f for _, f in outcomes if f is not None), None)
        if failed is not None:
            return openai_error(failed[1], failed[0], headers=failed[2])
        answers = [a for a, _ in outcomes]
        prompt_tokens = answers[0]["prompt_tokens"]
        completion_tokens = sum(a["completion_tokens"] for a in answers)
        return Response.json(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body["model"],
                "choices": [
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": a["text"]},
                        "finish_reason": FINISH_REASONS.get(a["finish_reason"], "stop"),
                        "logprobs": None,
                    }
                    for i, a in enumerate(answers)
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }
        )
