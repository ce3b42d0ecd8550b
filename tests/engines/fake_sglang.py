"""A protocol-faithful stand-in for ``python -m sglang.launch_server`` (SGLang cannot be
installed on CPU machines), for the pinned version of ``engines/sglang/protocol.json``.
The adapter starts it in place of SGLang when ``RELAY_SGLANG_LAUNCH=tests.engines.fake_sglang``
(relay's setting naming the module the adapter runs with ``python -m``), also under
``relay train`` and ``relay judge``, whose workers inherit the variable.

- Arguments: exactly the pinned version's server arguments (flags and aliases, switches and
  values, built from the protocol record): an unknown flag exits with status 2, as SGLang's
  argparse does.
- ``FAKE_SGLANG_RECORD=DIR``: every request (method, path, query, JSON body; weight payloads
  decoded to their tensor names and sums) and, first, the start (argv and the environment
  that matters) go to ``DIR/sglang-<port>.jsonl``, one JSON line each, for tests to read.
- ``FAKE_SGLANG_TOKEN_DELAY``: seconds per generated token (default 0.002).
- ``/generate``: ``max_new_tokens`` defaults to 128; the reply carries ``text``,
  ``output_ids`` and ``meta_info`` with ``finish_reason`` {type, ...},
  ``output_token_logprobs`` as ``[logprob, token_id, null]`` triples and ``weight_version``.
  Tokens are deterministic: token i of a reply is ``(sum(input_ids) + i) % 100 + 5``, plus
  ``sampling_seed`` when one is given with a temperature above 0 (so the samples of one prompt
  differ); ``text`` is their decoding by the model's ``tokenizer.json`` when it has one.
  Sampling keys SGLang's ``SamplingParams`` does not take are refused (400), as SGLang does.
- ``/flush_cache`` answers 400 while requests run; ``/release_memory_occupation`` refuses
  (500, like SGLang's assertion) unless the server is fully idle, and answers ``null``.
- After releasing ``weights`` without ``--enable-weights-cpu-backup`` the weights are gone
  until ``/update_weights_from_*``; generating while released is an error (500).
- ``/update_weights_from_tensor``: one payload per TP rank, each unpickled with SGLang's
  restricted unpickler rules (torch and a few standard modules only).
- ``/init_weights_update_group`` joins the trainer's group as SGLang does (a TCP
  rendezvous, ``PrefixStore(group_name)``, torch's ``_new_process_group_helper``; one TP rank
  only here) and ``/update_weights_from_distributed`` receives each bucket over it
  (``load_format="flattened_bucket"``: one flat buffer, tensors back to back).
- ``/v1/loads`` answers SGLang's shape (``{"loads": [{"num_running_reqs", ...}]}``);
  ``GET /server_info`` the parsed arguments and a log of control calls.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import pickle
import sys
import time

from aiohttp import web

from engines.sglang.args import protocol

SGLANG_SAMPLING_KEYS = set(protocol()["sampling_params"])
SAFE_PREFIXES = ("builtins.", "collections.", "copyreg.", "functools.", "torch.", "torch._tensor.",
                 "torch.storage.", "multiprocessing.reduction.")  # a subset of SGLang's SafeUnpickler's


def parse(argv=None):
    p = argparse.ArgumentParser(prog="sglang.launch_server (fake)")
    for field, spec in protocol()["server_args"].items():
        names = [spec["flag"], *spec["aliases"]]
        if spec["kind"] == "switch":
            p.add_argument(*names, dest=field, action="store_true")
        else:
            p.add_argument(*names, dest=field)
    args = p.parse_args(argv)
    for name in ("port", "tp_size", "dp_size", "pp_size", "ep_size", "base_gpu_id", "context_length",
                 "max_total_tokens"):
        value = getattr(args, name)
        setattr(args, name, int(value) if value is not None else (1 if name.endswith("_size") else None))
    if args.mem_fraction_static is not None:
        args.mem_fraction_static = float(args.mem_fraction_static)
    return args


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if not (module + ".").startswith(SAFE_PREFIXES):
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed by SGLang's SafeUnpickler")
        return super().find_class(module, name)


def _tensor_sums(named) -> dict:
    return {n: round(float(t.double().sum()), 6) for n, t in named}


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
        self.groups: dict = {}
        self.token_delay = float(os.environ.get("FAKE_SGLANG_TOKEN_DELAY", "0.002"))
        self.tokenizer = None
        if os.path.exists(os.path.join(args.model_path, "tokenizer.json")):
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(os.path.join(args.model_path, "tokenizer.json"))
        record = os.environ.get("FAKE_SGLANG_RECORD")
        self.record = os.path.join(record, f"sglang-{args.port}.jsonl") if record else None
        env = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "SGLANG_MEMORY_SAVER_CUDA_GRAPH",
                                              "PYTORCH_CUDA_ALLOC_CONF")}
        self.write({"event": "start", "pid": os.getpid(), "argv": sys.argv[1:], "env": env})

    def write(self, entry: dict) -> None:
        if self.record:
            with open(self.record, "a") as f:
                f.write(json.dumps({"t": time.time(), **entry}) + "\n")

    @web.middleware
    async def recorder(self, request: web.Request, handler):
        body = None
        if request.can_read_body:
            try:
                body = await request.json()
            except ValueError:
                body = "<not JSON>"
        request["body"] = body
        entry = {"method": request.method, "path": request.path, "query": dict(request.query), "body": body}
        if isinstance(body, dict) and "serialized_named_tensors" in body:
            entry["body"] = {**body, "serialized_named_tensors": len(body["serialized_named_tensors"])}
        request["entry"] = entry
        try:
            return await handler(request)
        finally:
            if request.path not in ("/health", "/health_generate", "/v1/loads", "/server_info"):
                self.write(entry)

    async def generate(self, request: web.Request) -> web.Response:
        body = request["body"]
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
        seed = sp.get("sampling_seed") or 0 if sp.get("temperature", 1.0) > 0 else 0
        out, finish = [], {"type": "length", "length": max_new}
        self.running[rid] = asyncio.current_task()
        try:
            for i in range(max_new):
                await asyncio.sleep(self.token_delay)
                tok = (sum(ids) + i + seed) % 100 + 5
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
        return web.json_response({"text": self.decode(out), "output_ids": out, "meta_info": meta})

    def decode(self, ids: list) -> str:
        if self.tokenizer is None:
            return "".join(chr(65 + t % 26) for t in ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def health(self, request):
        return web.Response(text="", status=200)

    async def flush_cache(self, request):
        self.log.append("flush_cache")
        if self.running:
            return web.Response(text="Cache not flushed: requests are running", status=400)
        return web.Response(text="Cache flushed.", status=200)

    async def release(self, request):
        tags = (request["body"] or {}).get("tags") or ["kv_cache", "weights", "cuda_graph"]
        self.log.append(["release", tags])
        if self.running:  # SGLang asserts is_fully_idle()
            return web.json_response({"error": {"message": "AssertionError: not fully idle"}}, status=500)
        self.released.update(tags)
        if "weights" in tags and not self.args.enable_weights_cpu_backup:
            self.weights_valid = False
        return web.json_response(None)

    async def resume(self, request):
        tags = (request["body"] or {}).get("tags") or ["kv_cache", "weights", "cuda_graph"]
        self.log.append(["resume", tags])
        self.released.difference_update(tags)
        return web.json_response(None)

    async def pause(self, request):
        self.log.append(["pause", (request["body"] or {}).get("mode", "abort")])
        self.paused = True
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def cont(self, request):
        self.log.append("continue")
        self.paused = False
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort(self, request):
        body = request["body"] or {}
        self.log.append(["abort", body.get("rid"), body.get("abort_all", False)])
        for rid, task in list(self.running.items()):
            if body.get("abort_all") or rid == body.get("rid"):
                task.cancel()
        await asyncio.sleep(0)
        return web.Response(status=200)

    def _updated(self, request, kind: str, sums: dict, body: dict) -> web.Response:
        self.log.append([kind, list(sums)])
        request["entry"]["tensors"] = sums
        self.weights_valid = True
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def update_from_tensor(self, request):
        body = request["body"]
        payloads = body["serialized_named_tensors"]
        if len(payloads) != self.args.tp_size:
            return web.json_response({"success": False, "message": "one payload per TP rank"}, status=400)
        try:
            named = [_SafeUnpickler(io.BytesIO(base64.b64decode(p))).load() for p in payloads]
        except Exception as e:  # noqa: BLE001 - what SGLang would answer
            return web.json_response({"success": False, "message": f"{type(e).__name__}: {e}"}, status=400)
        return self._updated(request, "update_weights_from_tensor", _tensor_sums(named[0]), body)

    def _join(self, body: dict):
        """SGLang's init_custom_process_group, for TP rank 0."""
        import datetime

        from torch.distributed.distributed_c10d import (
            Backend,
            PrefixStore,
            _new_process_group_helper,
            _world,
            rendezvous,
        )

        timeout = datetime.timedelta(seconds=60)
        init = f"tcp://{body['master_address']}:{body['master_port']}"
        store, rank, world = next(rendezvous(init, body["rank_offset"], body["world_size"], timeout=timeout))
        store.set_timeout(timeout)
        store = PrefixStore(body.get("group_name", "weight_update_group"), store)
        pg, _ = _new_process_group_helper(world, rank, [], Backend(body.get("backend", "nccl")), store,
                                          group_name=body.get("group_name", "weight_update_group"),
                                          backend_options=None, timeout=timeout)
        _world.pg_group_ranks[pg] = {i: i for i in range(world)}
        return pg

    async def init_group(self, request):
        body = request["body"]
        self.log.append(["init_weights_update_group", body])
        if self.args.tp_size != 1:
            return web.json_response({"success": False, "message": "the fake joins as one TP rank"}, status=400)
        try:
            self.groups[body.get("group_name", "weight_update_group")] = await asyncio.to_thread(self._join, body)
        except Exception as e:  # noqa: BLE001 - what SGLang answers
            return web.json_response({"success": False, "message": f"Failed to initialize: {e}."}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update_distributed(self, request):
        import torch
        import torch.distributed as dist

        body = request["body"]
        pg = self.groups.get(body.get("group_name", "weight_update_group"))
        if pg is None:
            return web.json_response({"success": False, "message": "call init_weights_update_group first"}, status=400)
        tensors = [torch.empty(s, dtype=getattr(torch, d)) for d, s in zip(body["dtypes"], body["shapes"])]
        if body.get("load_format") == "flattened_bucket":
            flat = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8)

            def receive():
                opts = dist.BroadcastOptions()
                opts.rootRank = 0
                pg.broadcast([flat], opts).wait()

            await asyncio.to_thread(receive)
            off = 0
            for t in tensors:
                n = t.numel() * t.element_size()
                t.view(-1).view(torch.uint8).copy_(flat[off : off + n])
                off += n
        else:
            return web.json_response({"success": False, "message": "the fake takes flattened buckets"}, status=400)
        return self._updated(request, "update_weights_from_distributed", _tensor_sums(zip(body["names"], tensors)),
                             body)

    async def destroy_group(self, request):
        import torch.distributed as dist

        pg = self.groups.pop((request["body"] or {}).get("group_name", "weight_update_group"), None)
        if pg is None:
            return web.json_response({"success": False, "message": "The group to be destroyed does not exist."},
                                     status=400)
        dist.destroy_process_group(pg)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def loads(self, request):
        load = {"dp_rank": 0, "num_running_reqs": len(self.running), "num_waiting_reqs": 0,
                "memory": {"weight_gb": 0.0 if "weights" in self.released else 0.001,
                           "kv_cache_gb": 0.0 if "kv_cache" in self.released else 0.001, "graph_gb": 0.0}}
        return web.json_response({"timestamp": "", "version": protocol()["sglang_version"], "loads": [load]})

    async def server_info(self, request):
        return web.json_response(
            {
                "args": vars(self.args),
                "log": self.log,
                "released": sorted(self.released),
                "weight_version": self.weight_version,
                "last_sampling_params": self.last_sampling_params,
            }
        )

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.recorder], client_max_size=1 << 30)
        r = app.router
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        for path, handler in (("/flush_cache", self.flush_cache), ("/release_memory_occupation", self.release),
                              ("/resume_memory_occupation", self.resume)):
            r.add_get(path, handler, allow_head=False)
            r.add_post(path, handler)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/continue_generation", self.cont)
        r.add_post("/abort_request", self.abort)
        r.add_post("/update_weights_from_tensor", self.update_from_tensor)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/update_weights_from_distributed", self.update_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/server_info", self.server_info)
        return app


def main(argv=None):
    args = parse(argv)
    web.run_app(FakeServer(args).app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
