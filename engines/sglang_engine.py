"""The SGLang adapter: the Engine interface over a ``python -m sglang.launch_server``
process and its documented HTTP API (docs/engines.md, "The SGLang adapter"; sglang 0.5.x).

Pitfalls it handles: release asserts the server is idle, so sleep first pauses (abort
mode), aborts everything and retries ``/flush_cache`` while it answers 400 (busy), then
releases and waits until the GPU memory is really freed; ``max_new_tokens`` defaults to 128
on the server, so it is always sent; generation resumes (``/continue_generation``) only
after a full wake; judges run with ``--enable-weights-cpu-backup`` so their weights survive
a release; the process tree is killed on close.

SGLang is CUDA-only and is not installed on the CPU machines: tests drive this adapter
against a protocol-faithful fake server (tests/engines/fake_sglang.py), started through the
same launch command with ``RELAY_SGLANG_LAUNCH`` naming the module.
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import socket
import subprocess
import sys
import time

from .interface import (
    TAGS,
    Engine,
    EngineFailed,
    EngineStepError,
    GenerateResult,
    check_tags,
    checked_sampling,
)

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
    def __init__(
        self,
        model_path: str,
        *,
        tp_size: int = 1,
        dp_size: int = 1,
        pp_size: int = 1,
        ep_size: int = 1,
        mem_fraction_static: float | None = None,
        context_length: int | None = None,
        base_gpu_id: int = 0,
        port: int | None = None,
        colocated: bool = True,
        weights_cpu_backup: bool = False,
        extra_args: dict | None = None,
        start_timeout: float = 900.0,
        drain_timeout: float = 120.0,
        name: str = "sglang",
    ):
        self.model_path = model_path
        self.name = name
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.colocated = colocated
        self.weights_cpu_backup = weights_cpu_backup
        self.start_timeout = start_timeout
        self.drain_timeout = drain_timeout
        self.args = server_args(
            model_path,
            tp_size,
            dp_size,
            pp_size,
            ep_size,
            mem_fraction_static,
            context_length,
            base_gpu_id,
            self.port,
            colocated,
            weights_cpu_backup,
            extra_args or {},
        )
        self.proc: subprocess.Popen | None = None
        self._session = None
        self._asleep: set[str] = set()
        self.weight_version = 0
        self._rid = 0
        self._tok = None  # the HF tokenizer, loaded on first use (see tokenizer)
        self.events: list[tuple] = []

    # ------------------------------------------------------------------ process

    async def start(self) -> None:
        import aiohttp

        import relay

        module = relay.settings().sglang_launch
        self.proc = subprocess.Popen([sys.executable, "-m", module, *self.args], start_new_session=True)
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
            weight_version=_version(meta.get("weight_version"), self.weight_version),
        )

    # ------------------------------------------------------------------ control

    async def _generate_call(self, body: dict) -> dict:
        """POST /generate, its failures typed as the engine contract has them: a 4xx is the
        request's own error (ValueError); a 5xx or a broken connection fails this request
        (EngineStepError) while the server lives, and EngineFailed once it has exited. A
        cancelled caller's request is aborted in the server."""
        import aiohttp

        try:
            async with self._session.post(f"{self.url}/generate", json=body) as r:
                try:
                    data = await r.json(content_type=None)
                except Exception:  # noqa: BLE001 - reported as text below
                    data = await r.text()
        except asyncio.CancelledError:
            asyncio.get_running_loop().create_task(self._abort_quietly(body["rid"]))
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

    async def _abort_quietly(self, rid: str) -> None:
        try:
            await self._post("/abort_request", {"rid": rid, "abort_all": False})
        except Exception:  # noqa: BLE001 - best effort: the server may be gone
            pass

    async def pause(self) -> None:
        await self._post("/pause_generation", {"mode": "abort"})

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
        await self._post("/release_memory_occupation", {"tags": tags})
        await self._wait_released(before)
        self._asleep.update(tags)
        self.events.append((time.monotonic(), "sleep", tuple(tags)))

    async def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while time.monotonic() < deadline:
            async with self._session.get(f"{self.url}/v1/loads") as r:
                data = await r.json(content_type=None)
            if not data.get("num_running_reqs", 0) and not data.get("num_waiting_reqs", 0):
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{self.name}: requests did not finish within {self.drain_timeout:g} s")

    async def _wait_released(self, before: int | None, timeout: float = 30.0) -> None:
        """The release call can return before the memory is free (slime#579): wait for it."""
        if before is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if _gpu_free() > before:
                return
            await asyncio.sleep(0.05)

    async def wake(self, tags=("weights", "kv_cache")) -> None:
        tags = [t for t in check_tags(tags) if t in self._asleep]
        if tags:
            await self._post("/resume_memory_occupation", {"tags": tags})
            self._asleep.difference_update(tags)
            self.events.append((time.monotonic(), "wake", tuple(tags)))
        if not (self._asleep & set(TAGS)):
            await self.resume()  # only after a full wake

    def weight_sync_info(self) -> dict:
        """SGLang takes weights through :meth:`update_weights` (the relay path)."""
        return {"backend": "sglang", "device_type": "cuda", "uuid": None}

    async def update_weights(self, buckets, version: int) -> None:
        """Colocated: tensors by CUDA IPC handles (``/update_weights_from_tensor``); the
        receiver copies device to device. Otherwise use :meth:`update_weights_distributed`."""
        import torch.multiprocessing.reductions  # noqa: F401 (registers the CUDA IPC reducers)

        for bucket in buckets:
            items = list(bucket.items() if isinstance(bucket, dict) else bucket)
            payload = base64.b64encode(_forking_dumps(items)).decode()
            await self._post(
                "/update_weights_from_tensor",
                {
                    "serialized_named_tensors": [payload] * max(1, int(self.args[self.args.index("--tp-size") + 1])),
                    "flush_cache": True,
                    "weight_version": str(version),
                },
            )
        self.weight_version = version
        self.events.append((time.monotonic(), "update_weights", version))

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout_s: float = 600.0,
    ) -> None:
        """Join SGLang's server to a broadcast group (``timeout_s`` is the server's own)."""
        await self._post(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    async def update_weights_distributed(
        self,
        names: list,
        dtypes: list,
        shapes: list,
        version: int,
        broadcast=None,
        group_name: str = "weight_update_group",
    ) -> None:
        """Announce a bucket, then let the trainer broadcast it (``broadcast()``) while the
        server receives it over the NCCL group set up by :meth:`init_weights_update_group`."""
        request = asyncio.ensure_future(
            self._post(
                "/update_weights_from_distributed",
                {
                    "names": names,
                    "dtypes": dtypes,
                    "shapes": shapes,
                    "group_name": group_name,
                    "flush_cache": True,
                    "weight_version": str(version),
                },
            )
        )
        if broadcast is not None:
            await asyncio.to_thread(broadcast)
        await request
        self.weight_version = version

    async def health(self) -> dict:
        try:
            async with self._session.get(f"{self.url}/health_generate") as r:
                ok = r.status == 200
        except Exception as e:
            return {"status": "unhealthy", "name": self.name, "error": str(e)}
        return {"status": "healthy" if ok else "unhealthy", "name": self.name}

    async def stats(self) -> dict:
        async with self._session.get(f"{self.url}/v1/loads") as r:
            loads = await r.json(content_type=None)
        return {
            "running": loads.get("num_running_reqs", 0),
            "waiting": loads.get("num_waiting_reqs", 0),
            "weight_version": self.weight_version,
            "asleep": sorted(self._asleep),
            "bytes": loads.get("memory", {}),
        }


def _version(reported, fallback: int) -> int:
    """SGLang reports weight_version as a string ("default" until the first update)."""
    try:
        return int(reported)
    except (TypeError, ValueError):
        return fallback


def _forking_dumps(items: list) -> bytes:
    """Serialize named tensors as SGLang's MultiprocessingSerializer expects. CUDA tensors go
    as CUDA IPC handles (ForkingPickler), so the server maps our GPU memory and copies
    device to device; CPU tensors go by value (an fd-sharing handle would need a shared
    multiprocessing authkey, which an unrelated server process does not have)."""
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    if not any(getattr(t, "is_cuda", False) for _, t in items):
        return pickle.dumps(items)
    buf = io.BytesIO()
    ForkingPickler(buf).dump(items)
    return buf.getvalue()


def server_args(
    model_path, tp, dp, pp, ep, mem_fraction, context_length, base_gpu_id, port, colocated, backup, extra
) -> list[str]:
    """Our config -> ``sglang.launch_server`` arguments."""
    args = [
        "--model-path",
        model_path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tp-size",
        str(tp),
        "--dp-size",
        str(dp),
        "--pp-size",
        str(pp),
        "--ep-size",
        str(ep),
        "--base-gpu-id",
        str(base_gpu_id),
        "--skip-server-warmup",
    ]
    if mem_fraction is not None:
        args += ["--mem-fraction-static", str(mem_fraction)]
    if context_length is not None:
        args += ["--context-length", str(context_length)]
    if colocated:
        args.append("--enable-memory-saver")
    if backup:
        args.append("--enable-weights-cpu-backup")
    for k, v in extra.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            args.append(flag)
        elif v not in (False, None):
            args += [flag, str(v)]
    return args


def _gpu_free() -> int | None:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.mem_get_info()[0]
    except Exception:
        pass
    return None
