"""Who holds the GPU memory when, in colocated layouts: the rollout and judge engines sleep
and wake, the trainer offloads and onloads (the order of one step: launcher/rl/loop.py).
Every move is a ``swap`` phase of the step, and each kind of move is also a span of its own
(``time/swap_<move>``: ``rollout_sleep``, ``judge_wake``, ``judge_sleep``, ``trainer_onload``,
``trainer_offload``, ``rollout_wake_weights``, ``rollout_wake_kv``), so a slow swap says
which part is slow.

After training, the rollout engines wake their weights *beside* the trainer's state when
every GPU has room for them (the engines' ``weights_bytes`` and the trainer's free-memory
figures, per physical GPU, with :data:`MARGIN_BYTES` to spare): the weight sync then reads
the trainer's device-resident parameters, and the trainer offloads after it. Otherwise the
trainer offloads first, and the sync brings the parameters back to the device for its
duration (one more host-to-device copy of them).

After the sync, the trainer stays on the device (no offload now, no onload before the next
training) when every GPU also has room for what the engines will wake beside it until then:
each engine's ``wake_bytes`` (weights and a KV cache as large as before), the rollout's and
the judge's by turns in Defer-swap (the rollout sleeps before the judge wakes), together
otherwise, with :func:`engine_margin` to spare for their activations. The engines still
sleep and wake in the same order; only the trainer's copies to and from the host go.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

from . import timeouts
from .engine_pool import call_engines, engine_bytes

MARGIN_BYTES = 1 << 30  # left free on a GPU when the rollout weights wake beside the trainer


def engine_margin(total: int) -> int:
    """Left free on a GPU of ``total`` bytes for the engines' activations, sampling and CUDA
    graphs when they wake beside the trainer's state: 5% of it, at least MARGIN_BYTES. (An
    engine whose KV cache is sized by ``mem_fraction_static`` takes at most 95% of the free
    memory it finds: 5% of the GPU to spare beyond its cache lets it take the same size.)"""
    return max(MARGIN_BYTES, total // 20)


class GpuSwaps:
    """The colocated loop's memory moves (no-ops with dedicated pools): of ``roles``
    (``rollout``, ``judge``, ``trainer``: launcher/rl/startup.py's Roles, filled in at
    start), each timed by ``timer``, as ``layout`` (launcher/allocator.py) has them."""

    def __init__(self, roles, timer, layout):
        self.roles, self.timer, self.layout = roles, timer, layout

    @contextlib.contextmanager
    def _move(self, what: str):
        with self.timer.phase("swap"), self.timer.span(f"swap_{what}"):
            yield

    async def open_judge_window(self) -> None:
        """Defer-swap: the rollout sleeps, then the judge wakes."""
        with self._move("rollout_sleep"):
            await self.roles.rollout.sleep()
        with self._move("judge_wake"):
            await self.roles.judge.wake()

    async def close_judge_window(self) -> None:
        with self._move("judge_sleep"):
            await self.roles.judge.sleep()

    async def free_for_training(self, memory: dict) -> None:
        """Colocated: the judge and the rollout engines sleep (in Defer-swap they already
        do), then the trainer onloads. ``memory`` gets ``mem/engine_bytes_training``."""
        roles = self.roles
        if not self.layout.colocated:
            return
        if not self.layout.judge_takes_turns:
            with self._move("judge_sleep"):
                await roles.judge.sleep()
            with self._move("rollout_sleep"):
                await roles.rollout.sleep()
        memory["mem/engine_bytes_training"] = await engine_bytes(roles.rollout.engines + roles.judge.engines)
        with self._move("trainer_onload"):
            await roles.trainer.onload()

    async def wake_rollout_weights(self) -> bool:
        """Colocated, after training: the rollout engines wake their weights' memory (the
        weights themselves come with the sync). True when they woke beside the trainer's
        state (the caller offloads the trainer after the sync: :meth:`offload_trainer`);
        False when the trainer offloaded first, for want of room."""
        roles = self.roles
        if not self.layout.colocated:
            return False
        with self._move("rollout_wake_weights"):  # the check is part of the move
            beside = await self.room_beside_trainer()
        if not beside:
            await self.offload_trainer()
        with self._move("rollout_wake_weights"):
            await roles.rollout.wake(["weights"])
        return beside

    async def offload_trainer(self) -> None:
        with self._move("trainer_offload"):
            await self.roles.trainer.offload()

    async def offload_trainer_unless_room(self, memory: dict | None = None) -> bool:
        """After the sync (the trainer resident, the rollout weights awake): the trainer
        offloads unless every GPU has room for the engines' wakes beside it
        (:meth:`room_for_engines`). True when it stays on the device (``memory`` gets
        ``mem/trainer_stays_on_device``: 1 or 0)."""
        with self._move("trainer_offload"):  # the check is part of the move
            stay = await self.room_for_engines()
        if not stay:
            await self.offload_trainer()
        if memory is not None:
            memory["mem/trainer_stays_on_device"] = int(stay)
        return stay

    async def room_for_engines(self) -> bool:
        """Does every GPU have room, beside the trainer's state, for the engines' wakes until
        the next training: the rollout's KV cache now (its weights are awake), then in
        Defer-swap the judge's weights and cache once the rollout slept (otherwise both
        together), with :func:`engine_margin` to spare? False when an engine or the trainer
        cannot say."""
        roles = self.roles
        engines = roles.rollout.engines + roles.judge.engines
        infos = await call_engines(engines, "weight_sync_info", timeout=timeouts.CONTROL)
        figures = await roles.trainer.gpu_memory(release_cache=True)
        free = {m.get("uuid"): (m["free"], m["total"]) for m in figures if m.get("uuid") and m["total"]}
        if not infos or not free or len(infos) != len(engines):
            return False
        awake: dict = defaultdict(int)  # the rollout weights, awake now: freed before the judge wakes
        needs: dict = {"rollout": defaultdict(int), "judge": defaultdict(int)}
        for engine, info in zip(engines, infos):
            wake, weights = info.get("wake_bytes"), info.get("weights_bytes")
            if not isinstance(wake, int) or not isinstance(weights, int) or wake <= 0:
                return False
            gpus = list(free) if int(info.get("tp_size", 1)) > 1 else [info.get("uuid")]
            for uuid in gpus:
                if uuid not in free:
                    return False
                needs["rollout" if engine.role == "rollout" else "judge"][uuid] += wake
                if engine.role == "rollout":
                    awake[uuid] += weights
        for uuid, (room, total) in free.items():
            rollout, judge = needs["rollout"][uuid], needs["judge"][uuid]
            need = max(rollout, judge) if self.layout.judge_takes_turns else rollout + judge
            if need + engine_margin(total) > room + awake[uuid]:
                return False
        return True

    async def resume_generation(self) -> None:
        """Colocated: the rollout engines wake their KV cache; the judge wakes (in Defer-swap
        it sleeps until the next batch is scored)."""
        roles = self.roles
        if not self.layout.colocated:
            return
        with self._move("rollout_wake_kv"):
            await roles.rollout.wake(["kv_cache"])
        if not self.layout.judge_takes_turns:
            with self._move("judge_wake"):
                await roles.judge.wake()

    async def room_beside_trainer(self) -> bool:
        """Does every GPU the rollout engines use have room for their weights beside the
        trainer's state, with :data:`MARGIN_BYTES` to spare? False when either side cannot say
        (an engine that does not report ``weights_bytes``, a trainer on CPU)."""
        roles = self.roles
        infos = await call_engines(roles.rollout.engines, "weight_sync_info", timeout=timeouts.CONTROL)
        figures = await roles.trainer.gpu_memory(release_cache=True)
        free = {m.get("uuid"): m["free"] for m in figures if m.get("uuid") and m["total"]}
        if not infos or not free:
            return False
        need: dict = defaultdict(int)
        for info in infos:
            size = info.get("weights_bytes")
            if not isinstance(size, int) or info.get("uuid") not in free:
                return False
            if int(info.get("tp_size", 1)) > 1:  # its other ranks' GPUs: count it on every trainer GPU
                for uuid in free:
                    need[uuid] += size
            else:
                need[info["uuid"]] += size
        return all(need[u] + MARGIN_BYTES <= free[u] for u in need)
