"""The colocated loop's memory moves (launcher/rl/swaps.py): the rollout weights wake beside
the trainer's state only when every GPU has room for them, the trainer stays on the device
after the sync only when every GPU has room for the engines' wakes beside it, and each move
is timed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from launcher.allocator import Layout
from launcher.rl.engine_pool import PooledEngine
from launcher.rl.swaps import MARGIN_BYTES, GpuSwaps, engine_margin
from launcher.rl.timing import PhaseTimer

GB = 1 << 30


class _Call:
    def __init__(self, value):
        self.value = value

    async def result(self, timeout):
        return self.value


def _engine(info: dict, role: str = "rollout") -> PooledEngine:
    stats = {"bytes": {"weights": 0, "kv_cache": 0}}
    instance = "" if role == "rollout" else "judge"
    actor = SimpleNamespace(weight_sync_info=SimpleNamespace(call_one=lambda: _Call(info)),
                            stats=SimpleNamespace(call_one=lambda: _Call(stats)))
    return PooledEngine(role, instance, actor)


class _Roles:
    """Records the order of the moves; the trainer reports ``free`` bytes per GPU."""

    def __init__(self, infos: list[dict], free: dict, judge_infos: tuple = ()):
        self.log: list[str] = []
        self.engines = [_engine(i) for i in infos]
        judge_engines = [_engine(i, "genrm") for i in judge_infos]
        self.free = free
        log = self.log

        class Pool:
            engines = self.engines

            async def wake(self, tags):
                log.append(f"rollout.wake{tags}")

            async def sleep(self):
                log.append("rollout.sleep")

        class Judge:
            engines = judge_engines

            async def wake(self):
                log.append("judge.wake")

            async def sleep(self):
                log.append("judge.sleep")

        class Trainer:
            async def gpu_memory(self, release_cache=False):
                log.append(f"trainer.gpu_memory(release_cache={release_cache})")
                return [{"uuid": u, "free": f, "total": 80 * GB} for u, f in free.items()]

            async def offload(self):
                log.append("trainer.offload")

            async def onload(self):
                log.append("trainer.onload")

        self.rollout, self.judge, self.trainer = Pool(), Judge(), Trainer()


def _loop(infos: list[dict], free: dict, defer: bool = False, judge_infos: tuple = ()) -> SimpleNamespace:
    roles = _Roles(infos, free, judge_infos)
    return SimpleNamespace(roles=roles, timer=PhaseTimer(), log=roles.log,
                           layout=Layout("colocate-defer" if defer else "colocate-split"))


def _swaps(loop) -> GpuSwaps:
    return GpuSwaps(loop.roles, loop.timer, loop.layout)


def _wake(loop) -> bool:
    return asyncio.run(_swaps(loop).wake_rollout_weights())


def test_rollout_weights_wake_beside_the_trainer_only_when_every_gpu_has_room():
    two = [{"uuid": "A", "weights_bytes": 2 * GB}, {"uuid": "A", "weights_bytes": 2 * GB}]
    roomy = _loop(two, {"A": 4 * GB + MARGIN_BYTES})
    assert _wake(roomy) is True
    assert roomy.log == ["trainer.gpu_memory(release_cache=True)", "rollout.wake['weights']"]  # no offload yet

    tight = _loop(two, {"A": 4 * GB + MARGIN_BYTES - 1})  # both engines on GPU A: 1 byte short
    assert _wake(tight) is False
    assert tight.log[1:] == ["trainer.offload", "rollout.wake['weights']"]

    spread = _loop([{"uuid": "A", "weights_bytes": 2 * GB}, {"uuid": "B", "weights_bytes": 2 * GB}],
                   {"A": 3 * GB + MARGIN_BYTES, "B": 3 * GB + MARGIN_BYTES})
    assert _wake(spread) is True
    one_short = _loop([{"uuid": "A", "weights_bytes": 2 * GB}, {"uuid": "B", "weights_bytes": 2 * GB}],
                      {"A": 3 * GB + MARGIN_BYTES, "B": GB})
    assert _wake(one_short) is False


def test_without_figures_the_trainer_offloads_first():
    # an engine that does not say its size (SGLang), one on a GPU no trainer rank reports, a CPU trainer
    for infos, free in (([{"uuid": "A", "backend": "sglang"}], {"A": 80 * GB}),
                        ([{"uuid": "B", "weights_bytes": GB}], {"A": 80 * GB}),
                        ([{"uuid": None, "weights_bytes": GB}], {})):
        loop = _loop(infos, free)
        assert _wake(loop) is False, infos
        assert "trainer.offload" in loop.log


def test_a_tensor_parallel_engine_needs_room_on_every_trainer_gpu():
    tp2 = [{"uuid": "A", "weights_bytes": 2 * GB, "tp_size": 2}]
    assert _wake(_loop(tp2, {"A": 3 * GB + MARGIN_BYTES, "B": 3 * GB + MARGIN_BYTES})) is True
    assert _wake(_loop(tp2, {"A": 3 * GB + MARGIN_BYTES, "B": GB})) is False


def test_each_move_is_a_swap_phase_and_a_span_of_its_own():
    loop = _loop([{"uuid": "A", "weights_bytes": GB}], {"A": 80 * GB})
    swaps = _swaps(loop)
    loop.timer.begin_step()

    async def step(memory):
        await swaps.free_for_training(memory)
        assert await swaps.wake_rollout_weights()
        await swaps.offload_trainer()
        await swaps.resume_generation()

    memory: dict = {}
    asyncio.run(step(memory))
    assert memory == {"mem/engine_bytes_training": 0}
    assert loop.log == ["judge.sleep", "rollout.sleep", "trainer.onload", "trainer.gpu_memory(release_cache=True)",
                        "rollout.wake['weights']", "trainer.offload", "rollout.wake['kv_cache']", "judge.wake"]
    m = loop.timer.metrics()
    moves = ("judge_sleep", "rollout_sleep", "trainer_onload", "rollout_wake_weights", "trainer_offload",
             "rollout_wake_kv", "judge_wake")
    assert all(f"time/swap_{w}" in m for w in moves), sorted(m)
    assert m["time/swap"] >= sum(m[f"time/swap_{w}"] for w in moves) - 1e-9


def test_dedicated_pools_move_nothing():
    loop = _loop([{"uuid": "A", "weights_bytes": GB}], {"A": 80 * GB})
    loop.layout = Layout("dedicated")
    swaps = _swaps(loop)

    async def step():
        await swaps.free_for_training({})
        assert not await swaps.wake_rollout_weights()
        await swaps.resume_generation()

    asyncio.run(step())
    assert loop.log == []


def _stays(loop) -> bool:
    return asyncio.run(_swaps(loop).offload_trainer_unless_room())


def test_the_trainer_stays_on_the_device_only_when_the_engines_wakes_fit_beside_it():
    margin = engine_margin(80 * GB)
    rollout = [{"uuid": "A", "weights_bytes": 2 * GB, "wake_bytes": 10 * GB}]
    judge = ({"uuid": "A", "weights_bytes": 2 * GB, "wake_bytes": 30 * GB},)
    # Defer-swap: the judge wakes after the rollout slept (its awake weights freed): by turns
    fits = _loop(rollout, {"A": 30 * GB + margin - 2 * GB}, defer=True, judge_infos=judge)
    assert _stays(fits) is True
    assert fits.log == ["trainer.gpu_memory(release_cache=True)"]  # no offload
    short = _loop(rollout, {"A": 30 * GB + margin - 2 * GB - 1}, defer=True, judge_infos=judge)
    assert _stays(short) is False and short.log[-1] == "trainer.offload"
    # co-resident engines wake together
    assert _stays(_loop(rollout, {"A": 40 * GB + margin - 2 * GB}, judge_infos=judge)) is True
    assert _stays(_loop(rollout, {"A": 40 * GB + margin - 2 * GB - 1}, judge_infos=judge)) is False
    # every GPU counts: a judge on another GPU needs its room there
    spread = ({"uuid": "B", "weights_bytes": 2 * GB, "wake_bytes": 30 * GB},)
    assert _stays(_loop(rollout, {"A": 40 * GB, "B": 30 * GB + margin}, defer=True, judge_infos=spread)) is True
    assert _stays(_loop(rollout, {"A": 40 * GB, "B": 29 * GB}, defer=True, judge_infos=spread)) is False
    # the margin: 5% of the GPU, at least MARGIN_BYTES
    assert margin == 4 * GB and engine_margin(8 * GB) == MARGIN_BYTES


def test_without_wake_figures_the_trainer_offloads_after_the_sync():
    # SGLang (no wake_bytes), an engine that never allocated (0), a CPU trainer, an unknown GPU
    for infos, free in (([{"uuid": "A", "weights_bytes": GB}], {"A": 80 * GB}),
                        ([{"uuid": "A", "weights_bytes": GB, "wake_bytes": 0}], {"A": 80 * GB}),
                        ([{"uuid": None, "weights_bytes": GB, "wake_bytes": 2 * GB}], {}),
                        ([{"uuid": "B", "weights_bytes": GB, "wake_bytes": 2 * GB}], {"A": 80 * GB})):
        loop = _loop(infos, free, defer=True)
        assert _stays(loop) is False, infos
        assert loop.log[-1] == "trainer.offload"
