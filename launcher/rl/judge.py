"""The judge as the RL loop sees it: its engines, the judge service (in a process of its
own, serving the HTTP gateway), sleeping and waking around training, and the counts
behind the ``judge/*`` metrics.

The service's relay address is :attr:`Judge.address`: the loop hands it to the built-in
reward functions as a parameter (``make_reward_fn(cfg, judge_address=...)``). It is also
exported as ``RELAY_GENRM_ADDR`` (docs/judge.md), for user reward code that calls
``get_genrm_client()`` without an address, in this process or in any it starts.
"""

from __future__ import annotations

import asyncio
import os

import relay
from relay import Actor, ActorError

from . import timeouts
from .engine_pool import PooledEngine, call_engines, graph_capture_s
from .rollout import ALL_MEMORY


class _ImportAhead(Actor):
    """Imports what the judge service's setup needs (transformers' tokenizers), in its
    process, while the launcher starts the other roles (:func:`judge_process`)."""

    async def setup(self) -> None:
        await asyncio.to_thread(__import__, "transformers.models.auto.tokenization_auto")


def judge_process():
    """The process the judge service will run in, started now: it imports its libraries
    while the launcher starts the trainer and engines; give it to :meth:`Judge.start_service`."""
    procs = relay.this_host().spawn_procs(per_host={"procs": 1}, name="genrm")
    procs.spawn("import-ahead", _ImportAhead)
    return procs


class Judge:
    """The judge engines and, once :meth:`start_service` ran, the judge service. Without
    judge engines (a reward that needs no judge) every method is a no-op."""

    def __init__(self, cfg, engines: list[PooledEngine]):
        self.cfg = cfg
        self.engines = engines
        self.service = None  # the JudgeService actor mesh
        self.service_procs = None  # its process
        self.address: str | None = None

    async def start_service(self, out, procs=None) -> None:
        """Start the judge service over the engines (in ``procs``: :func:`judge_process`'s,
        started earlier, else a new process), export its address and open
        the HTTP gateway on 127.0.0.1:``--genrm-gateway-port`` (0: any free port; printed)."""
        from reward.judge import start_judge_service

        if not self.engines:
            if procs is not None:
                await procs.stop()
            return
        specs = {name: {"model_path": inst.model_path, "num_gpus": inst.num_gpus,
                        "sampling_config": inst.sampling_config,
                        "engines": [e.mesh for e in self.engines if e.instance == name],
                        "placement": [e.place for e in self.engines if e.instance == name],
                        "num_gpus_per_engine": inst.num_gpus_per_engine,
                        "max_context_len": inst.engine_config.get("max_context_len")}
                 for name, inst in self.cfg.genrm.items()}
        self.service, self.service_procs = await start_judge_service(specs, timeouts.JUDGE_SERVICE_START, procs)
        self.address = self.service_procs.procs[0].addr
        os.environ["RELAY_GENRM_ADDR"] = self.address  # for user reward code (see the module docstring)
        try:
            port = await self.service.serve_http.call_one(
                "127.0.0.1", self.cfg.genrm_gateway_port, None, self.cfg.gateway_limits(),
                503 if self.cfg.genrm_gateway_unhealthy_503 else 200).result(timeouts.CONTROL)
        except ActorError as e:  # e.g. the port is taken: say which option to change
            raise RuntimeError(f"{e.exception} (--genrm-gateway-port; 0 picks a free one)") from None
        os.environ["RELAY_GENRM_URL"] = f"http://127.0.0.1:{port}/genrm"  # for reward code, as the address
        print(f"judge gateway: http://127.0.0.1:{port}/genrm/health", file=out, flush=True)

    async def set_admission(self, is_open: bool) -> None:
        """Open or close every instance's admission: while closed, the service answers
        ``JudgeAsleep`` at once."""
        for name in self.cfg.genrm:
            await self.service.set_awake.call_one(name, is_open).result(timeouts.CONTROL)

    async def sleep_engines(self) -> None:
        """The engines free their memory after finishing the verdicts in flight (weights
        kept in CPU memory)."""
        await call_engines(self.engines, "sleep", ALL_MEMORY, "finish")

    async def sleep(self) -> None:
        """Close admission, then put the engines to sleep."""
        if not self.engines:
            return
        await self.set_admission(False)
        await self.sleep_engines()

    async def wake(self) -> None:
        """Wake the engines, then reopen admission."""
        if not self.engines:
            return
        await call_engines(self.engines, "wake", ALL_MEMORY)
        await self.set_admission(True)

    async def counts(self) -> dict:
        """Cumulative counters of the service and its engines, for :func:`judge_deltas`
        ({} without a judge)."""
        if self.service is None:
            return {}
        snapshot = await self.service.metrics_snapshot.call_one().result(timeouts.CONTROL)
        stats = await call_engines(self.engines, "stats")
        totals: dict = {"requests": 0, "cache_hits": 0, "parse_failures": 0, "latency_sum": 0.0, "latency_count": 0,
                        "engine_requests": sum(s.get("requests_finished", 0) for s in stats),
                        "graph_capture_s": graph_capture_s(stats)}
        for instance in snapshot.values():
            for key in ("requests", "cache_hits", "parse_failures"):
                totals[key] += instance.get(key, 0)
            histogram = instance.get("latency_s") or {}  # cumulative since start
            totals["latency_sum"] += histogram.get("sum", 0.0)
            totals["latency_count"] += histogram.get("count", 0)
        return totals

    async def stop(self) -> None:
        """Stop the service (and its gateway)."""
        if self.service_procs is not None:
            await self.service_procs.stop()
            self.service_procs = None


def judge_deltas(before: dict, after: dict) -> dict:
    """The judge's work between two :meth:`Judge.counts` snapshots, as ``judge/*`` metrics."""
    if not after:
        return {}
    calls = after["requests"] - before["requests"]
    hits = after["cache_hits"] - before["cache_hits"]
    latency_count = after["latency_count"] - before["latency_count"]
    latency_sum = after["latency_sum"] - before["latency_sum"]
    return {"judge/requests": calls, "judge/cache_hits": hits, "judge/engine_calls": calls - hits,
            "judge/cache_hit_rate": hits / calls if calls else 0.0,
            "judge/parse_failures": after["parse_failures"] - before["parse_failures"],
            "judge/parse_failure_rate": (after["parse_failures"] - before["parse_failures"]) / calls if calls else 0.0,
            "judge/latency_mean": latency_sum / latency_count if latency_count else 0.0,
            "judge/engine_requests": after["engine_requests"] - before["engine_requests"],
            # an engine rebuilt meanwhile starts its count again: never below 0
            "judge/graph_capture_s": max(0.0, after["graph_capture_s"] - before["graph_capture_s"])}
