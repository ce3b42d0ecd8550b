"""The SGLang adapter: the Engine interface over a ``python -m sglang.launch_server`` process
spanning the engine's GPUs, driven through SGLang's HTTP API as pinned in
``engines/sglang/protocol.json`` (sglang 0.5.15.post1; docs/engines.md, "The SGLang adapter").
Its command line comes from the engine options every backend takes
(``engines.sglang.args.server_fields``); every request it sends is checked against the
pinned version's routes and request keys.

Pitfalls it handles: release asserts the server is idle, so sleep first pauses (abort
mode), aborts everything and retries ``/flush_cache`` while it answers 400 (busy), then
releases and waits until the GPU memory is really freed; ``max_new_tokens`` defaults to 128
on the server, so it is always sent; generation resumes (``/continue_generation``) only
after a full wake; judges run with ``--enable-weights-cpu-backup`` so their weights survive
a release; a live weight update pauses (retract) and continues around it; the process tree
is killed on close.

SGLang is CUDA-only and is not installed on the CPU machines: tests drive this adapter
against a protocol-faithful fake server (tests/engines/fake_sglang.py), started through the
same launch command with ``RELAY_SGLANG_LAUNCH`` naming the module. It has not run against
a real SGLang server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

from engines.interface import (
    CONSTRAINTS,
    TAGS,
    Engine,
    EngineFailed,
    EngineStepError,
    GenerateResult,
    check_tags,
    checked_sampling,
)
from engines.settings import settings as engines_settings
from engines.sglang import weights as sglang_weights
from engines.sglang.args import check_request, protocol, server_argv, server_env, server_fields, version_problem

#: SamplingParams keys that SGLang's /generate takes under the same name and meaning.
SGLANG_PASSTHROUGH = ("min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_new_tokens",
                      "skip_special_tokens", "no_stop_trim")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SGLangError(RuntimeError):
    pass


class SGLangEngine(Engine):
    """One SGLang server (``python -m sglang.launch_server``) spanning the engine's GPUs.

    Takes the engine options every backend takes (``engines.interface.ENGINE_OPTIONS``):
    ``device``, ``weights_mode`` (``"discard"``: a rollout engine, refilled by weight sync;
    ``"backup"``: a judge, ``--enable-weights-cpu-backup``), ``offload`` (it releases memory
    for co-tenants: ``--enable-memory-saver``), ``mem_fraction_static``, ``kv_cache_tokens``
    (``--max-total-tokens``), ``gpu_ids`` (the node's GPU ids it spans: ``--tp-size`` and
    ``--base-gpu-id``) and ``engine_config`` (dp/pp/ep sizes, context length and any other
    server argument of the pinned version; unknown keys are dropped with a warning). See
    ``engines.sglang.args.server_fields``."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cuda",
        weights_mode: str = "backup",
        offload: bool = False,
        mem_fraction_static: float | None = None,
        kv_cache_tokens: int | None = None,
        gpu_ids: list | None = None,
        engine_config: dict | None = None,
        port: int | None = None,
        start_timeout: float = 900.0,
        drain_timeout: float = 120.0,
        name: str = "sglang",
    ):
        self.model_path = model_path
        self.name = name
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.device = device
        self.offload = offload
        self.start_timeout = start_timeout
        self.drain_timeout = drain_timeout
        self.fields = server_fields(model_path, self.port, device=device, weights_mode=weights_mode, offload=offload,
                                    mem_fraction_static=mem_fraction_static, kv_cache_tokens=kv_cache_tokens,
                                    gpu_ids=gpu_ids, engine_config=engine_config)
        self.args = server_argv(self.fields)
        self.env = server_env(gpu_ids, offload)
        self.proc: subprocess.Popen | None = None
        self._session = None
        self._asleep: set[str] = set()
        self._paused_for_sync = False  # /pause_generation sent for a live weight update
        self.weight_version = 0
        self._rid = 0
        self._tok = None  # the HF tokenizer, loaded on first use (see tokenizer)
        self.events: list[tuple] = []

    # ------------------------------------------------------------------ process

    async def start(self) -> None:
        import aiohttp

        module = engines_settings().sglang_launch
        problem = version_problem(module)
        if problem:
            raise SGLangError(f"{self.name}: {problem}")
        self.proc = subprocess.Popen([sys.executable, "-m", module, *self.args], env=self.env, start_new_session=True)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600))
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise SGLangError(
                    f"{self.name}: sglang server exited with code {self.proc.returncode} during start-up (args: "
                    f"{' '.join(self.args)})"
                )
            try:
                async with self._session.get(
                    f"{self.url}/health_generate", timeout=aiohttp.ClientTimeout(total=30)
                ) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                await self.close()
                raise SGLangError(f"{self.name}: sglang server not healthy within {self.start_timeout:g} s")
            await asyncio.sleep(0.5)

    async def close(self) -> None:
        """Kill the server's whole process tree (it runs in its own session)."""
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)

    async def _post(self, route: str, body: dict | None = None, ok=(200,)) -> tuple[int, dict | str]:
        check_request(route, body)  # a key the pinned SGLang does not take is our bug: fail loudly
        async with self._session.post(f"{self.url}{route}", json=body or {}) as r:
            try:
                data = await r.json(content_type=None)
            except Exception:
                data = await r.text()
            if r.status not in ok:
                raise SGLangError(f"{self.name}: POST {route} -> {r.status}: {data}")
            return r.status, data

    # ------------------------------------------------------------------ generation

    @property
    def tokenizer(self):
        """The model's HF tokenizer, loaded on first use (chat messages and rendered chats are
        tokenized here; plain text goes to the server as text)."""
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.model_path)
        return self._tok

    async def generate(self, prompt, sampling=None, chat_template_kwargs=None) -> GenerateResult:
        if self._asleep:
            raise RuntimeError(f"{self.name}: asleep ({sorted(self._asleep)}); wake it before generating")
        request_sampling = checked_sampling(sampling)  # n > 1 is fanned out above (interface.generate_n)
        params = {
            "temperature": request_sampling.temperature,
            "top_p": request_sampling.top_p,
            "top_k": request_sampling.top_k,
            "max_new_tokens": request_sampling.max_new_tokens,  # always sent: the server's default is 128
            "ignore_eos": request_sampling.ignore_eos,
        }
        for key in SGLANG_PASSTHROUGH:  # SGLang's own keys, sent as they are (SGLang's defaults are ours)
            params[key] = getattr(request_sampling, key)
        if request_sampling.stop:
            params["stop"] = list(request_sampling.stop)
        if request_sampling.stop_token_ids:
            params["stop_token_ids"] = list(request_sampling.stop_token_ids)
        if request_sampling.seed is not None:
            params["sampling_seed"] = request_sampling.seed
        for key in CONSTRAINTS:  # SGLang's constrained decoding, as given
            if getattr(request_sampling, key) is not None:
                params[key] = getattr(request_sampling, key)
        self._rid += 1
        body = {
            "rid": f"{self.name}-{self._rid}",
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,
        }
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            out = self.tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, **(chat_template_kwargs or {})
            )
            body["input_ids"] = list(out["input_ids"] if hasattr(out, "keys") else out)
        elif isinstance(prompt, str):
            body["text"] = prompt
        else:
            body["input_ids"] = list(prompt)
        started_version = self.weight_version  # the version that began it (staleness counts from the start)
        data = await self._generate_call(body)
        meta = data["meta_info"]
        lps = meta.get("output_token_logprobs") or []
        finish = (meta.get("finish_reason") or {}).get("type", "stop")
        return GenerateResult(
            token_ids=list(data.get("output_ids") or [t[1] for t in lps]),
            text=data.get("text", ""),
            logprobs=[t[0] for t in lps],
            finish_reason=finish if finish in ("stop", "length", "abort") else "stop",
            prompt_tokens=meta.get("prompt_tokens", 0),
            weight_version=min(started_version, _version(meta.get("weight_version"), self.weight_version)),
        )

    # ------------------------------------------------------------------ control

    async def _generate_call(self, body: dict) -> dict:
        """POST /generate, its failures typed as the engine contract has them: a 4xx is the
        request's own error (ValueError); a 5xx or a broken connection fails this request
        (EngineStepError) while the server lives, and EngineFailed once it has exited. A
        cancelled caller's request is aborted in the server."""
        import aiohttp

        check_request("/generate", body)
        try:
            async with self._session.post(f"{self.url}/generate", json=body) as r:
                try:
                    data = await r.json(content_type=None)
                except Exception:  # noqa: BLE001 - reported as text below
                    data = await r.text()
        except asyncio.CancelledError:
            asyncio.get_running_loop().create_task(_abort_quietly(self, body["rid"]))
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineFailed(f"{self.name}: the sglang server exited (code {self.proc.returncode})") from None
            raise EngineStepError(f"{self.name}: POST /generate failed: {type(e).__name__}: {e}") from None
        if 400 <= r.status < 500:
            raise ValueError(f"{self.name}: sglang refused the request ({r.status}): {str(data)[:200]}")
        if r.status != 200 or not isinstance(data, dict) or "meta_info" not in data:
            raise EngineStepError(f"{self.name}: POST /generate -> {r.status}: {str(data)[:200]}")
        return data

    async def pause(self, mode: str = "abort") -> None:
        await self._post("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._post("/continue_generation", {})

    async def abort(self, request_ids=None) -> int:
        if request_ids is None:
            await self._post("/abort_request", {"rid": "", "abort_all": True})
            return -1
        for rid in request_ids:
            await self._post("/abort_request", {"rid": rid, "abort_all": False})
        return len(request_ids)

    async def _drain(self) -> None:
        """Pause (abort mode), abort everything, and flush until the server is idle (400 = busy)."""
        await self.pause()
        deadline = time.monotonic() + self.drain_timeout
        while True:
            await self.abort()
            status, _ = await self._post("/flush_cache", {}, ok=(200, 400))
            if status == 200:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: timeout while draining before release ({self.drain_timeout:g} s)")
            await asyncio.sleep(0.1)

    async def sleep(self, tags=("weights", "kv_cache"), drain: str = "abort") -> None:
        tags = [t for t in check_tags(tags) if t not in self._asleep]
        if not tags:
            return
        if drain == "finish":
            await self._wait_idle()
        await self._drain()
        before = _gpu_free()
        await self._post("/release_memory_occupation", {"tags": _server_tags(tags)})
        await _wait_released(before)
        self._asleep.update(tags)
        self.events.append((time.monotonic(), "sleep", tuple(tags)))

    async def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while time.monotonic() < deadline:
            running, waiting, _ = await _loads(self._session, self.url)
            if not running and not waiting:
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{self.name}: requests did not finish within {self.drain_timeout:g} s")

    async def wake(self, tags=("weights", "kv_cache")) -> None:
        tags = [t for t in check_tags(tags) if t in self._asleep]
        if tags:
            await self._post("/resume_memory_occupation", {"tags": _server_tags(tags)})
            self._asleep.difference_update(tags)
            self.events.append((time.monotonic(), "wake", tuple(tags)))
        if not (self._asleep & set(TAGS)):
            await self.resume()  # only after a full wake

    # ------------------------------------------------------------------ weight sync

    def weight_sync_info(self) -> dict:
        """What the trainer's sender needs (engines.weight_sync.sender): colocated on CUDA,
        the UUID of the engine's first GPU (a trainer rank there sends by CUDA IPC through
        ``/update_weights_from_tensor``); otherwise a broadcast group with SGLang's
        ``/init_weights_update_group`` (``ranks``: one per TP rank) and its flattened-bucket
        layout (``align`` 1); on CPU the relay path (``update_weights``)."""
        uuid = None
        if self.device == "cuda" and self.offload:  # the colocated trainer rank's process: CUDA is up already
            from engines.weight_sync import device_uuid

            uuid = device_uuid("cuda")
        return {"backend": "sglang", "device_type": self.device, "uuid": uuid, "ranks": self.fields["tp_size"],
                "align": 1, "group_protocol": "sglang", "engine_id": f"{self.name}-{self.port}-{id(self)}"}

    async def _begin_update(self) -> None:
        """A live engine (awake: not colocated) stops scheduling while its weights change;
        retract mode keeps the requests in flight (they resume after the update). A
        sleeping one was drained by sleep and resumes with wake."""
        if not self._asleep and not self._paused_for_sync:
            await self.pause("retract")
            self._paused_for_sync = True

    async def _end_update(self, version: int) -> None:
        self.weight_version = version
        self.events.append((time.monotonic(), "update_weights", version))
        if self._paused_for_sync:
            self._paused_for_sync = False
            await self.resume()

    async def update_weights(self, buckets, version: int) -> None:
        """The relay path: CPU tensors by value through ``/update_weights_from_tensor`` (one
        payload per TP rank), a bucket at a time."""
        buckets = list(buckets)
        await self._begin_update()
        for i, bucket in enumerate(buckets):
            items = list(bucket.items() if isinstance(bucket, dict) else bucket)
            body = _tensor_request(self.fields, sglang_weights.by_value(items), version, i == len(buckets) - 1)
            await self._post("/update_weights_from_tensor", body)
        await self._end_update(version)

    async def update_weights_from_ipc(self, handle: dict, metas: list, version: int, last: bool = True) -> None:
        """Colocated: one flat bucket the trainer shared by CUDA IPC, handed on to the server
        as views of that buffer (``/update_weights_from_tensor``): every TP rank maps it
        and copies device to device; the trainer frees it after this returns."""
        await self._begin_update()
        uuid = self.weight_sync_info()["uuid"]
        payload = sglang_weights.by_ipc_handle(handle, metas, uuid)
        await self._post("/update_weights_from_tensor", _tensor_request(self.fields, payload, version, last))
        if last:
            await self._end_update(version)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl", timeout_s: float = 600.0) -> None:
        """The server's TP ranks join the trainer's broadcast group as ranks
        ``rank_offset .. rank_offset + tp_size - 1`` (SGLang builds it with a
        ``PrefixStore(group_name)``; the trainer's side must too: engines.weight_sync)."""
        if self.fields["pp_size"] != 1:
            raise ValueError(f"{self.name}: weight sync by broadcast into an SGLang engine with pp_size > 1 is not "
                             "supported (each pipeline stage would need its own group)")
        await self._post("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    async def update_weights_from_distributed(self, names: list, dtypes: list, shapes: list, version: int,
                                              group_name: str = "weight_update_group", last: bool = True) -> None:
        """Announce one bucket; the server receives it over the group as one flat buffer
        (``load_format="flattened_bucket"``) while the trainer broadcasts it. Generation is
        paused (retract) from the first bucket of a version to the last."""
        await self._begin_update()
        await self._post("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name, "flush_cache": last,
            "weight_version": str(version), "load_format": "flattened_bucket"})
        if last:
            await self._end_update(version)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        await self._post("/destroy_weights_update_group", {"group_name": group_name}, ok=(200, 400))

    async def health(self) -> dict:
        try:
            async with self._session.get(f"{self.url}/health_generate") as r:
                ok = r.status == 200
        except Exception as e:
            return {"status": "unhealthy", "name": self.name, "error": str(e)}
        return {"status": "healthy" if ok else "unhealthy", "name": self.name}

    async def stats(self) -> dict:
        running, waiting, memory = await _loads(self._session, self.url)
        return {
            "running": running,
            "waiting": waiting,
            "weight_version": self.weight_version,
            "asleep": sorted(self._asleep),
            "bytes": memory,
            "sglang_version": protocol()["sglang_version"],
        }


def _server_tags(tags: list) -> list:
    """SGLang's tags for ours: the KV cache goes and comes back with the CUDA graphs (their
    memory is the saver's too, under ``SGLANG_MEMORY_SAVER_CUDA_GRAPH``), as slime and relax
    release everything and resume ``[kv_cache, cuda_graph]`` together."""
    out = list(tags)
    if "kv_cache" in out and "cuda_graph" not in out:
        out.append("cuda_graph")
    return out


def _tensor_request(fields: dict, payload: str, version: int, last: bool) -> dict:
    """An ``/update_weights_from_tensor`` body: the payload for every TP rank."""
    return {"serialized_named_tensors": [payload] * fields["tp_size"], "flush_cache": last,
            "weight_version": str(version)}


async def _abort_quietly(engine: SGLangEngine, rid: str) -> None:
    try:
        await engine._post("/abort_request", {"rid": rid, "abort_all": False})
    except Exception:  # noqa: BLE001 - best effort: the server may be gone
        pass


async def _wait_released(before: int | None, timeout: float = 30.0) -> None:
    """The release call can return before the memory is free (slime#579): wait for it."""
    if before is None:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gpu_free() > before:
            return
        await asyncio.sleep(0.05)


async def _loads(session, url: str) -> tuple[int, int, dict]:
    """``GET /v1/loads``: running and waiting requests summed over the DP ranks, and the
    memory the server reports (bytes per tag)."""
    async with session.get(f"{url}/v1/loads") as r:
        data = await r.json(content_type=None)
    loads = data.get("loads") or []
    memory: dict = {}
    for load in loads:
        for tag, key in (("weights", "weight_gb"), ("kv_cache", "kv_cache_gb"), ("cuda_graph", "graph_gb")):
            gb = (load.get("memory") or {}).get(key)
            if gb is not None:
                memory[tag] = memory.get(tag, 0) + int(gb * (1 << 30))
    running = sum(int(load.get("num_running_reqs", 0)) for load in loads)
    return running, sum(int(load.get("num_waiting_reqs", 0)) for load in loads), memory


def _version(reported, fallback: int) -> int:
    """SGLang reports weight_version as a string ("default" until the first update)."""
    try:
        return int(reported)
    except (TypeError, ValueError):
        return fallback


def _gpu_free() -> int | None:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.mem_get_info()[0]
    except Exception:
        pass
    return None
