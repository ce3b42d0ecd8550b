"""The rollout pool: the policy's engines, their sleep and wake, generating a group of
samples for one prompt, and the prompts' token ids."""

from __future__ import annotations

import asyncio
import json
import random
import threading

from ..data import Row, prompt_ids
from . import timeouts
from .engine_pool import GONE, PooledEngine, answered, call_engines, graph_capture_s, held_bytes, live
from .sample import Sample

#: what an engine frees when it sleeps and restores when it wakes
ALL_MEMORY = ["weights", "kv_cache"]


def sampling_options(cfg, evaluation: bool = False) -> dict:
    """Sampling of a training rollout, or of an evaluation (``--eval-*``)."""
    if evaluation:
        temperature = cfg.rollout_temperature if cfg.eval_temperature is None else cfg.eval_temperature
        return {"temperature": temperature, "top_p": cfg.eval_top_p,
                "max_new_tokens": cfg.eval_max_response_len or cfg.rollout_max_response_len}
    return {"temperature": cfg.rollout_temperature, "top_p": cfg.rollout_top_p,
            "max_new_tokens": cfg.rollout_max_response_len}


def group_seed(seed: int, step: int, key: int) -> int:
    """The first sampling seed of a group (sample j uses this + j), derived from (``--seed``,
    step, prompt key): a resumed run samples exactly what the original run would have.
    Multiplied by 64 so that groups of up to 64 samples never share a seed."""
    return random.Random(f"{seed}:{step}:{key}").randrange(1 << 30) * 64


def prompt_datasets(cfg, rows: list[Row], eval_sets: list[tuple[str, list[Row]]]) -> list[tuple[str, list[Row], int]]:
    """(what, rows, response tokens) of the job's prompts: training and every evaluation set
    (``(name, rows)``)."""
    out = [(f"--prompt-data {cfg.prompt_data}", rows, cfg.rollout_max_response_len)]
    for k, ((name, eval_rows), (_, path)) in enumerate(zip(eval_sets, cfg.eval_sets)):
        out.append((f"--eval-prompt-data {path}" if k == 0 else f"--eval-prompt-data {name} {path}", eval_rows,
                    cfg.eval_max_response_len or cfg.rollout_max_response_len))
    return out


_TOKENIZER_IMPORT = threading.Lock()


def auto_tokenizer():
    """transformers' ``AutoTokenizer``, imported under a lock: the controller imports it in a
    thread while the workers start (:func:`launcher.rl.startup.prepare_controller`), and two
    threads importing transformers' lazy modules at once can fail with ``ImportError:
    cannot import name 'AutoTokenizer'``."""
    with _TOKENIZER_IMPORT:
        from transformers import AutoTokenizer
    return AutoTokenizer


def tokenize_prompts(cfg, tokenizer, datasets: list[tuple[str, list[Row], int]]) -> dict:
    """Every prompt's token ids as the policy sees them, keyed as :class:`RolloutPool`
    caches them (run in a thread while the workers start)."""
    pool = RolloutPool(cfg, [], tokenizer)
    for _, rows, _ in datasets:
        for row in rows:
            pool.prompt_ids(row)
    return pool._prompt_ids


class RolloutPool:
    """The rollout engines. Generation goes to the least-loaded engine, a group at a time
    (all samples of one prompt on one engine)."""

    def __init__(self, cfg, engines: list[PooledEngine], tokenizer):
        self.cfg = cfg
        self.engines = engines
        self.tokenizer = tokenizer
        self.custom = None  # a launcher.rl.custom_rollout.CustomRollout, with --custom-generate-function-path
        # keyed by the prompt itself, never by row index: train and eval rows share indices
        self._prompt_ids: dict[tuple[str, str], list[int]] = {}

    def prompt_ids(self, row: Row) -> list[int]:
        """The row's prompt token ids as the policy sees them (cached by the prompt's content)."""
        if isinstance(row.prompt, str):
            key = ("text", row.prompt)
        else:
            key = ("chat", json.dumps(row.prompt, sort_keys=True))
        ids = self._prompt_ids.get(key)
        if ids is None:
            ids = prompt_ids(self.tokenizer, row.prompt, self.cfg.apply_chat_template, self.cfg.chat_template_kwargs)
            self._prompt_ids[key] = ids
        return ids

    async def check_context(self, known: dict, datasets: list[tuple[str, list[Row], int]]) -> None:
        """Every prompt of ``datasets`` (``known``: their token ids, :func:`tokenize_prompts`)
        with its response budget fits the rollout engines (their KV cache, the model's
        positions); else a ValueError at start names the rows, not a failed step later."""
        self._prompt_ids.update(known)
        limits = [s["max_context_tokens"] for s in await call_engines(self.engines, "stats")
                  if s.get("max_context_tokens")]
        if not limits:
            return
        limit = min(limits)
        for what, rows, budget in datasets:
            over = [(len(self.prompt_ids(r)), r.index) for r in rows if len(self.prompt_ids(r)) + budget > limit]
            if over:
                longest, index = max(over)
                raise ValueError(
                    f"{what}: {len(over)} prompt(s) do not fit the rollout engines, which take {limit} tokens "
                    f"(prompt + response; their KV cache and the model's positions): the longest, row {index}, has "
                    f"{longest} prompt tokens + {budget} response tokens. Drop or shorten those rows (rows "
                    f"{sorted(i for _, i in over)[:10]}), lower the response length, or give the engines more KV cache "
                    "(--kv-cache-tokens on CPU, --sglang-mem-fraction-static on GPU)")

    async def generate_group(self, row: Row, size: int, sampling: dict, seed: int, group_index: int,
                             dataset: str = "train") -> list[Sample]:
        """``size`` samples of ``row``'s prompt, sample j with seed ``seed + j``, on the
        least-loaded engine (through the ``--custom-generate-function-path`` function when
        there is one: :mod:`launcher.rl.custom_rollout`)."""
        if self.custom is not None:
            return await self.custom.group(self, row, size, sampling, seed, group_index, dataset)
        ids = self.prompt_ids(row)
        results = await self.on_one_engine([(ids, {**sampling, "seed": seed + j}) for j in range(size)])
        return [Sample.generated(row, dataset, group_index, ids, result) for result in results]

    async def on_one_engine(self, requests: list[tuple]) -> list:
        """GenerateResults of ``requests`` (``(prompt, sampling)`` each), all on the
        least-loaded engine. With fault tolerance, requests whose engine died are run again
        (same seeds) on another engine, or on the dead one's successor when none is left
        (waiting at most ``timeouts.ENGINE_REBUILD``)."""
        while True:
            engine = await self._least_loaded()
            engine.outstanding += len(requests)
            try:
                calls = [engine.mesh.generate.call_one(prompt, sampling).result(timeouts.GENERATE)
                         for prompt, sampling in requests]
                results = await asyncio.gather(*calls, return_exceptions=True)
            finally:
                engine.outstanding -= len(requests)
            gone = next((r for r in results if isinstance(r, GONE)), None)
            if gone is not None and engine.fault_tolerant:
                engine.mark_down(f"its process is gone ({gone})")
                continue
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            return results

    async def _least_loaded(self) -> PooledEngine:
        serving = live(self.engines)
        if not serving:  # every engine died: wait for the first successor
            waits = [asyncio.ensure_future(e.back.wait()) for e in self.engines]
            try:
                done, _ = await asyncio.wait(waits, timeout=timeouts.ENGINE_REBUILD,
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            if not done:
                raise RuntimeError(f"no rollout engine came back within {timeouts.ENGINE_REBUILD} s: "
                                   + "; ".join(str(e.down) for e in self.engines))
            serving = live(self.engines)
        return min(serving, key=lambda e: e.outstanding)

    async def sleep(self) -> None:
        """Free weights and KV cache (in-flight generations are aborted)."""
        await call_engines(self.engines, "sleep", ALL_MEMORY)

    async def wake(self, tags: list[str] = ALL_MEMORY) -> None:
        await call_engines(self.engines, "wake", tags)

    async def abort(self) -> None:
        """End every in-flight generation at once (each returns what it has so far)."""
        await call_engines(self.engines, "abort", timeout=timeouts.CONTROL)

    async def usage(self) -> tuple[int, float]:
        """(device bytes the engines hold, seconds they spent capturing decode CUDA graphs since
        they started), from one stats call."""
        stats = await call_engines(self.engines, "stats")
        return held_bytes(stats), graph_capture_s(stats)

    async def weight_versions(self) -> list[int]:
        return [s["weight_version"] for s in await call_engines(self.engines, "stats")]

    async def probe(self, row: Row) -> dict:
        """Greedy one-token answers of every engine to ``row``'s prompt (token, log-prob,
        weight version): the log-probs change when the weights do and agree across engines."""
        ids = self.prompt_ids(row)
        greedy = {"temperature": 0.0, "max_new_tokens": 1}
        engines = live(self.engines)
        answers = await asyncio.gather(*(e.mesh.generate.call_one(ids, greedy).result(timeouts.PROBE)
                                         for e in engines), return_exceptions=True)
        results = answered(engines, answers)
        return {"sync/probe_logprobs": [r.logprobs[0] for r in results],
                "sync/probe_tokens": [r.token_ids[0] for r in results],
                "sync/probe_versions": [r.weight_version for r in results]}
