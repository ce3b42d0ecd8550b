"""``relay judge --config X.yaml [--host H] [--port P] [--token T]``: only the judge — its
engines and the judge service (a process of its own, which serves the HTTP gateway) — on
this machine, until SIGINT/SIGTERM.

A judge model path that does not exist yet and sits under the cache directory (the tiny
configs' ``${RELAY_CACHE:-.cache}/models/tiny-judge``) is built on first use (a tiny random
Qwen3 with a local tokenizer: no download) and reused afterwards.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import relay
from engines.actor import EngineActor
from engines.model_builder import ensure_model
from launcher.config import JobConfig

from .judge import start_judge_service


async def run_judge(cfg: JobConfig, host: str, port: int, token: str | None, ready=None) -> int:
    if not cfg.genrm:
        print("relay judge: the config has no judge (set genrm_model_path or genrm_instances)", file=sys.stderr)
        return 2
    specs, meshes = {}, []
    for name, inst in cfg.genrm.items():
        path = ensure_model(inst.model_path)
        n_engines = inst.num_gpus // inst.num_gpus_per_engine
        procs = relay.this_host().spawn_procs(per_host={"engines": n_engines}, name=f"judge-{name}".replace("_", ""))
        kw = {"weights_mode": "backup"}
        if cfg.device == "cpu":
            kw["kv_cache_tokens"] = int(inst.engine_config.get("kv_cache_tokens", 8192))
        else:
            kw.update(device="cuda", mem_fraction_static=inst.mem_fraction_static or 0.8)
        engines = procs.spawn("engine", EngineActor, path, cfg.engine, **kw)
        meshes.append(procs)
        specs[name] = {
            "model_path": path, "num_gpus": inst.num_gpus, "sampling_config": inst.sampling_config,
            "engines": [engines.slice(engines=i) for i in range(n_engines)],
        }
        await engines.initialized(600)
    judge, judge_procs = await start_judge_service(specs, 600)
    meshes.append(judge_procs)
    try:
        port = await judge.serve_http.call_one(host, port, token).result(60)
    except relay.ActorError as e:
        print(f"relay judge: {e.exception}", file=sys.stderr)
        for procs in meshes:
            await procs.stop()
        return 2
    print(f"judge ready: http://{host}:{port}/genrm/health  (relay address for reward code: {judge_procs.procs[0].addr})", flush=True)
    if ready is not None:
        ready.set()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for procs in meshes:
        await procs.stop()
    print("judge stopped", flush=True)
    return 0
