"""``--custom-generate-function-path``: rollouts written for slime's contract (multi-turn,
tool calls), run unchanged.

The function is ``async def generate(args, sample, sampling_params) -> Sample``:

- ``args`` is the job's config, with ``args.sglang_router_ip`` and ``args.sglang_router_port``
  naming :class:`RolloutHTTP`, SGLang's ``POST /generate`` in front of the rollout engines
  (the least-loaded engine answers, with the weights and version every rollout has).
- ``sample`` comes with ``prompt`` (the text the policy sees: rendered by the chat template
  under ``--apply-chat-template``), ``tokens`` (its token ids), ``response`` ``""``,
  ``response_length`` 0, ``rollout_log_probs`` None, ``label``, ``metadata`` (the row's) and
  ``status`` PENDING (left so: COMPLETED).
- ``sampling_params`` are the rollout's (``temperature``, ``top_p``, ``max_new_tokens``)
  with ``sampling_seed``, the sample's seed (a resumed run samples the same).

It returns the sample with ``tokens`` (prompt, then response), ``response_length``,
``response`` (its text), ``loss_mask`` (0 on tokens the policy did not write, such as a
tool's output; None: every response token trains), ``rollout_log_probs`` (one per response
token, 0 where masked, from ``meta_info.output_token_logprobs`` of ``"return_logprob": true``;
None: no TIS) and ``status``; what it puts in ``metadata`` reaches the reward. A sample's
weight version is the oldest the rollout engines held when its function was called.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import uuid

from engines.interface import short_repr
from reward.http_messages import HttpLimits, Request, Response
from reward.httpd import HttpServer
from reward.rewards import load_callable

from ..data import Row, question_text
from .sample import Sample, Status

FLAG = "--custom-generate-function-path"
#: SGLang sampling keys that change nothing here (slime sends them with every request)
IGNORED_SAMPLING = ("spaces_between_special_tokens",)
#: the status of each finish reason, and back
FINISH = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


def engine_request(body) -> tuple[str | list[int], dict, bool]:
    """(prompt, engine sampling dict, return_logprob) of an SGLang ``/generate`` body with one
    prompt; ValueError naming what is wrong."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object with 'text' or 'input_ids' and 'sampling_params'")
    if body.get("stream") not in (None, False):
        raise ValueError("stream=true is not served: one JSON body answers each request")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ValueError("give exactly one of 'text' (a prompt string) and 'input_ids' (token ids)")
    if text is not None and (not isinstance(text, str) or not text):
        raise ValueError(f"'text' must be one non-empty prompt string (one prompt per request), got {short_repr(text)}")
    if ids is not None and (not isinstance(ids, list) or not ids
                            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise ValueError(f"'input_ids' must be one non-empty list of token ids (one prompt per request), "
                         f"got {short_repr(ids)}")
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise ValueError(f"'sampling_params' must be an object, got {short_repr(sampling)}")
    sampling = {k: v for k, v in sampling.items() if k not in IGNORED_SAMPLING}
    if "sampling_seed" in sampling:
        sampling["seed"] = sampling.pop("sampling_seed")
    return (text if text is not None else ids), sampling, bool(body.get("return_logprob"))


def sglang_answer(result, with_logprobs: bool) -> dict:
    """SGLang's ``/generate`` answer of one GenerateResult."""
    finish: dict = {"type": result.finish_reason}
    if result.finish_reason == "length":
        finish["length"] = len(result.token_ids)
    meta = {"id": uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(result.token_ids), "cached_tokens": 0, "weight_version": result.weight_version}
    if with_logprobs:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(result.logprobs, result.token_ids)]
    return {"text": result.text, "output_ids": list(result.token_ids), "meta_info": meta}


class RolloutHTTP:
    """SGLang's router routes (``POST /generate``, ``GET /health``, ``/health_generate``,
    ``/get_model_info``) over a :class:`~launcher.rl.rollout.RolloutPool`, on 127.0.0.1 of
    the controller's loop. Bad requests get 400 saying why; an engine failure 502."""

    def __init__(self, pool, model_path: str):
        self.pool = pool
        self.model_path = model_path
        self.requests = 0
        self.server = HttpServer(self.handle, HttpLimits(max_body=64 << 20))
        self._routes = {"/generate": ("POST", self.generate), "/health": ("GET", self.health),
                        "/health_generate": ("GET", self.health), "/get_model_info": ("GET", self.model_info)}

    async def handle(self, request: Request) -> Response:
        route = self._routes.get(request.path)
        if route is None:
            return _error(f"no route {short_repr(request.path)}; routes: {', '.join(self._routes)}", 404)
        if request.method != route[0] and not (route[0] == "GET" and request.method == "HEAD"):
            return _error(f"use {route[0]} on {request.path}", 405)
        return await route[1](request)

    async def generate(self, request: Request) -> Response:
        try:
            if request.headers.get("content-type", "").partition(";")[0].strip().lower() != "application/json":
                raise ValueError("send the body as JSON with 'Content-Type: application/json'")
            prompt, sampling, with_logprobs = engine_request(json.loads(request.body))
        except (ValueError, RecursionError) as e:
            return _error(f"Invalid request body: {e}", 400)
        self.requests += 1
        try:
            (result,) = await self.pool.on_one_engine([(prompt, sampling)])
        except Exception as e:  # noqa: BLE001 - answered, not raised
            inner = getattr(e, "exception", e)  # relay's ActorError carries the engine's own exception
            if isinstance(inner, (ValueError, TypeError)):
                return _error(f"Invalid request: {inner}", 400)
            return _error(f"the rollout engine failed: {type(inner).__name__}: {short_repr(str(inner), 300)}", 502)
        return Response.json(sglang_answer(result, with_logprobs))

    async def health(self, request: Request) -> Response:
        return Response.json({"status": "ok", "engines": len(self.pool.engines)})

    async def model_info(self, request: Request) -> Response:
        return Response.json({"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True})


def _error(message: str, status: int) -> Response:
    return Response.json({"error": {"message": message}}, status)


class CustomRollout:
    """The custom function and the HTTP server it generates through (:meth:`start`,
    :meth:`close`); :meth:`group` replaces a group's plain generation."""

    def __init__(self, cfg, pool):
        self.cfg = cfg
        self.fn = load_callable(cfg.custom_generate_function_path, FLAG)
        if not inspect.iscoroutinefunction(self.fn):
            raise ValueError(f"{FLAG} {cfg.custom_generate_function_path}: must be an async function "
                             "generate(args, sample, sampling_params) returning the sample")
        self.http = RolloutHTTP(pool, cfg.hf_checkpoint)
        self.port: int | None = None

    async def start(self) -> None:
        """Serve :class:`RolloutHTTP` and name it in ``args`` (``sglang_router_ip``/``_port``)."""
        self.port = await self.http.server.start("127.0.0.1", 0)
        self.cfg.sglang_router_ip, self.cfg.sglang_router_port = "127.0.0.1", self.port

    async def close(self) -> None:
        await self.http.server.close()

    def first_sample(self, pool, row: Row, dataset: str, group_index: int, version: int) -> Sample:
        """The sample a custom function is given (see the module docstring)."""
        ids = pool.prompt_ids(row)
        if self.cfg.apply_chat_template:
            msgs = row.prompt if isinstance(row.prompt, list) else [{"role": "user", "content": row.prompt}]
            prompt = pool.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False,
                                                        **(self.cfg.chat_template_kwargs or {}))
        else:
            prompt = question_text(row.prompt)
        return Sample(index=row.index, dataset=dataset, group_index=group_index, prompt=prompt, label=row.label,
                      metadata={"question": question_text(row.prompt), "label": row.label, **row.metadata},
                      prompt_ids=list(ids), response_ids=[], response="", rollout_logprobs=None, finish_reason="stop",
                      weight_version=version, status=Status.PENDING)

    async def group(self, pool, row: Row, size: int, sampling: dict, seed: int, group_index: int,
                    dataset: str) -> list[Sample]:
        version = min(await pool.weight_versions())
        samples = [self.first_sample(pool, row, dataset, group_index, version) for _ in range(size)]
        return list(await asyncio.gather(*(self._one(s, {**sampling, "sampling_seed": seed + j})
                                           for j, s in enumerate(samples))))

    async def _one(self, sample: Sample, sampling: dict) -> Sample:
        where = f"{FLAG} {self.cfg.custom_generate_function_path}"
        out = await self.fn(self.cfg, sample, dict(sampling))
        if isinstance(out, list):
            raise ValueError(f"{where} returned a list: one sample per call is trained here (slime's multi-sample "
                             "rollouts are not); return the sample it was given")
        if not isinstance(out, Sample):
            raise ValueError(f"{where} returned {type(out).__name__}, not the Sample it was given")
        out.settle(where)
        out.finish_reason = next(k for k, v in FINISH.items() if v is out.status)
        return out
