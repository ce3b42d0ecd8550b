"""``EngineActor``: an inference engine behind relay. The rest of the system talks to
engines only through this actor (generate, sleep/wake, update_weights, ...)."""

from __future__ import annotations

import asyncio

from relay import Actor, endpoint

from .interface import TAGS, GenerateResult


class EngineActor(Actor):
    """Hosts one engine. ``backend`` is "torch" (the built-in engine) or "sglang"."""

    def __init__(self, model_path: str, backend: str = "torch", **engine_kwargs):
        self.model_path = model_path
        self.backend = backend
        self.engine_kwargs = engine_kwargs
        self.engine = None

    async def setup(self) -> None:
        if self.backend == "torch":
            from .torch_engine import TorchEngine

            self.engine = TorchEngine(self.model_path, **self.engine_kwargs)
        elif self.backend == "sglang":
            from .sglang_engine import SGLangEngine

            self.engine = SGLangEngine(self.model_path, **self.engine_kwargs)
            await self.engine.start()
        else:
            raise ValueError(f"unknown engine backend {self.backend!r}; use 'torch' or 'sglang'")

    @endpoint(concurrent=True)
    async def generate(self, prompt, sampling: dict | None = None, chat_template_kwargs: dict | None = None) -> GenerateResult:
        return await self.engine.generate(prompt, sampling, chat_template_kwargs)

    @endpoint(concurrent=True)
    async def generate_batch(self, requests: list) -> list:
        """``requests``: a list of ``[prompt, sampling]``, run concurrently. One item per
        request, in order: its GenerateResult, or the exception it raised (the others are
        unaffected)."""
        return await asyncio.gather(*(self.engine.generate(p, s) for p, s in requests), return_exceptions=True)

    @endpoint
    async def sleep(self, tags: tuple = TAGS[:2], drain: str = "abort") -> None:
        await self.engine.sleep(tags, drain)

    @endpoint
    async def wake(self, tags: tuple = TAGS[:2]) -> None:
        await self.engine.wake(tags)

    @endpoint
    async def update_weights(self, buckets: list, version: int) -> None:
        await self.engine.update_weights(buckets, version)

    @endpoint(concurrent=True)
    async def pause(self) -> None:
        await self.engine.pause()

    @endpoint(concurrent=True)
    async def resume(self) -> None:
        await self.engine.resume()

    @endpoint(concurrent=True)
    async def abort(self, request_ids: list | None = None) -> int:
        return await self.engine.abort(request_ids)

    @endpoint(concurrent=True)
    async def health(self) -> dict:
        return await self.engine.health()

    @endpoint(concurrent=True)
    async def stats(self) -> dict:
        return await self.engine.stats()

    @endpoint(concurrent=True)
    async def events(self) -> list:
        return [list(e[:2]) + [list(e[2]) if isinstance(e[2], tuple) else e[2]] for e in getattr(self.engine, "events", [])]

    async def __cleanup__(self, exc) -> None:
        if self.engine is not None:
            await self.engine.close()
