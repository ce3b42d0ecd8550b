"""A protocol-faithful stand-in for ``python -m sglang.launch_server`` (SGLang cannot be
installed on CPU machines). Same arguments, same routes, same JSON shapes and the refusals
the adapter must cope with (docs/engines.md, "The SGLang adapter"):

- ``/generate``: ``max_new_tokens`` defaults to 128; the reply carries ``text``,
  ``output_ids`` and ``meta_info`` with ``finish_reason`` {type, ...},
  ``output_token_logprobs`` as ``[logprob, token_id, null]`` triples and ``weight_version``.
  Tokens are deterministic: token i of a reply is ``(sum(input_ids) + i) % 100 + 5``.
- ``/flush_cache`` answers 400 while requests run; ``/release_memory_occupation`` refuses
  (500, like SGLang's assertion) unless the server is fully idle.
- After releasing ``weights`` without ``--enable-weights-cpu-backup`` the weights are gone
  until ``/update_weights_from_*``; generating while released is an error.
- ``/generate`` refuses (400) sampling keys SGLang's ``SamplingParams`` does not take, as
  SGLang does (its constructor raises); the last request's ``sampling_params`` are kept.
- ``GET /server_info`` reports the parsed arguments and a log of control calls, so tests
  can check the adapter's mapping and ordering.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import pickle

from aiohttp import web


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    for a in ("--tp-size", "--dp-size", "--pp-size", "--ep-size", "--base-gpu-id"):
        p.add_argument(a, type=int, default=1 if a != "--base-gpu-id" else 0)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--context-length", type=int)
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--enable-weights-cpu-backup", action="store_true")
    p.add_argument("--skip-server-warmup", action="store_true")
    p.add_argument("--token-delay", type=float, default=0.002, help="fake seconds per generated token")
    args, unknown = p.parse_known_args(argv)
    args.unknown = unknown
    return args


#: The keyword arguments of SGLang's SamplingParams (python/sglang/srt/sampling/sampling_params.py).
SGLANG_SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "custom_params", "stream_interval", "logit_bias", "sampling_seed",
}


class FakeServer:
    def __init__(self, args):
        self.args = args
        self.running: dict[str, asyncio.Task] = {}
        self.paused = False
        self.released: set[str] = set()
        self.weights_valid = True
        self.weight_version = "default"
        self.log: list = []
        self.last_sampling_params: dict | None = None

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "weights" in self.released or not self.weights_valid or "kv_cache" in self.released:
            return web.json_response({"error": {"message": "memory released"}}, status=500)
        ids = body.get("input_ids") or [ord(c) % 100 for c in body.get("text", "")]
        sp = body.get("sampling_params") or {}
        unknown = sorted(set(sp) - SGLANG_SAMPLING_KEYS)
        if unknown:
            return web.json_response(
                {"error": {"message": f"SamplingParams.__init__() got an unexpected keyword argument {unknown[0]!r}"}},
                status=400,
            )
        self.last_sampling_params = sp
        max_new = sp.get("max_new_tokens", 128)  # SGLang's default
        limit = self.args.context_length
        if limit and len(ids) + max_new > limit:  # SGLang refuses it as the request's error
            return web.json_response(
                {
                    "error": {
                        "message": "Requested token count exceeds the model's maximum context length of "
                        f"{limit} tokens. You requested a total of {len(ids) + max_new} tokens"
                    }
                },
                status=400,
            )
        rid = body.get("rid") or f"r{len(self.log)}"
        stop_ids = set(sp.get("stop_token_ids") or [])
        out, finish = [], {"type": "length", "length": max_new}
        task = asyncio.current_task()
        self.running[rid] = task
        try:
            for i in range(max_new):
                if self.paused and not out:
                    pass
                await asyncio.sleep(self.args.token_delay)
                tok = (sum(ids) + i) % 100 + 5
                out.append(tok)
                if tok in stop_ids:
                    finish = {"type": "stop", "matched": tok}
                    break
        except asyncio.CancelledError:
            finish = {"type": "abort", "message": "Abort request", "status_code": 200, "err_type": None}
        finally:
            self.running.pop(rid, None)
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "output_token_logprobs": [[-0.5 - 0.01 * i, t, None] for i, t in enumerate(out)],
            "output_token_logprobs_length": len(out),
        }
        return web.json_response({"text": "".join(chr(65 + t % 26) for t in out), "output_ids": out, "meta_info": meta})

    async def health(self, request):
        return web.Response(text="", status=200)

    async def flush_cache(self, request):
        self.log.append("flush_cache")
        if self.running:
            return web.Response(text="Cache not flushed: requests are running", status=400)
        return web.Response(text="Cache flushed.", status=200)

    async def release(self, request):
        body = await request.json()
        tags = body.get("tags") or ["kv_cache", "weights", "cuda_graph"]
        self.log.append(["release", tags])
        if self.running:  # SGLang asserts is_fully_idle()
            return web.json_response({"error": {"message": "AssertionError: not fully idle"}}, status=500)
        self.released.update(tags)
        if "weights" in tags and not self.args.enable_weights_cpu_backup:
            self.weights_valid = False
        return web.json_response({"success": True, "message": ""})

    async def resume(self, request):
        body = await request.json()
        tags = body.get("tags") or ["kv_cache", "weights", "cuda_graph"]
        self.log.append(["resume", tags])
        self.released.difference_update(tags)
        return web.json_response({"success": True, "message": ""})

    async def pause(self, request):
        body = await request.json()
        self.log.append(["pause", body.get("mode", "abort")])
        self.paused = True
        return web.json_response({"success": True})

    async def cont(self, request):
        self.log.append("continue")
        self.paused = False
        return web.json_response({"success": True})

    async def abort(self, request):
        body = await request.json()
        self.log.append(["abort", body.get("rid"), body.get("abort_all", False)])
        for rid, task in list(self.running.items()):
            if body.get("abort_all") or rid == body.get("rid"):
                task.cancel()
        await asyncio.sleep(0)
        return web.json_response({"success": True})

    async def update_from_tensor(self, request):
        body = await request.json()
        payloads = body["serialized_named_tensors"]
        if len(payloads) != self.args.tp_size:
            return web.json_response({"success": False, "message": "one payload per TP rank"}, status=400)
        named = pickle.loads(base64.b64decode(payloads[0]))  # SGLang's MultiprocessingSerializer is pickle too
        self.log.append(["update_weights_from_tensor", [n for n, _ in named]])
        self.weights_valid = True
        self.weight_version = body.get("weight_version", self.weight_version)
        return web.json_response({"success": True, "message": "ok"})

    async def init_group(self, request):
        body = await request.json()
        self.log.append(["init_weights_update_group", body])
        return web.json_response({"success": True, "message": "ok"})

    async def update_distributed(self, request):
        body = await request.json()
        self.log.append(["update_weights_from_distributed", body["names"]])
        self.weights_valid = True
        self.weight_version = body.get("weight_version", self.weight_version)
        return web.json_response({"success": True, "message": "ok"})

    async def loads(self, request):
        return web.json_response({"num_running_reqs": len(self.running), "num_waiting_reqs": 0})

    async def server_info(self, request):
        a = vars(self.args).copy()
        return web.json_response(
            {
                "args": a,
                "log": self.log,
                "released": sorted(self.released),
                "weight_version": self.weight_version,
                "last_sampling_params": self.last_sampling_params,
            }
        )

    def app(self) -> web.Application:
        app = web.Application()
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_route("*", "/release_memory_occupation", self.release)
        r.add_route("*", "/resume_memory_occupation", self.resume)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/continue_generation", self.cont)
        r.add_post("/abort_request", self.abort)
        r.add_post("/update_weights_from_tensor", self.update_from_tensor)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/update_weights_from_distributed", self.update_distributed)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/server_info", self.server_info)
        return app


def main(argv=None):
    args = parse(argv)
    web.run_app(FakeServer(args).app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
