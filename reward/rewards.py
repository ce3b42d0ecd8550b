"""Reward functions by ``--rm-type`` / ``--custom-rm-path``, bounded by
``--reward-max-concurrency``, and the defer-swap post-process hook.

A sample is a :class:`launcher.rl.sample.Sample` (or a dict) with at least ``response`` and
``label`` (and ``prompt``, ``metadata``), read as attributes or by key. A custom reward is
called ``fn(args, sample)``: the original's ``async def f(args, sample, **kwargs)`` and
``def f(args, sample)`` both work. A reward returns a float or a dict;
``--reward-key`` picks the value the trainer uses from a dict (``score`` when not given).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from reward.settings import settings as reward_settings

from . import dapo_genrm, math_grader, math_verify_grader

RewardFn = Callable[[dict], Awaitable[Any]]


#: The directory user code (``--custom-rm-path`` and other ``module.func`` flags) resolves
#: from, as ``python -m`` does: the working directory the job was started in.
USER_PATH_ENV = "RELAY_USER_PATH"


def use_working_directory() -> str:
    """Put the working directory first on ``sys.path``, as ``python -m`` does, so that a
    ``module.func`` flag such as ``examples.post_process_genrm_swap.f`` imports the same way
    under the ``relay`` console script as under ``python -m launcher``. Processes started
    afterwards inherit it: relay workers through the spawner's ``sys.path``, any other
    process through ``PYTHONPATH`` (and ``RELAY_USER_PATH`` names the directory). Idempotent."""
    cwd = reward_settings().user_path or os.getcwd()
    if not sys.path or sys.path[0] != cwd:
        if cwd in sys.path:
            sys.path.remove(cwd)
        sys.path.insert(0, cwd)
    os.environ[USER_PATH_ENV] = cwd
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not parts or parts[0] != cwd:
        os.environ["PYTHONPATH"] = os.pathsep.join([cwd, *(p for p in parts if p != cwd)])
    return cwd


OUR_PACKAGES = ("relay", "engines", "reward", "launcher")  # a user's package of one of these names is shadowed


def load_callable(path: str, what: str) -> Callable:
    """``module.func`` (or ``module:func``), imported from ``sys.path`` (the working directory
    first under relay's entry points), or ``path/to/file.py:func``, loaded from that file
    (relative to ``RELAY_USER_PATH`` or the working directory) -> the function. The error
    names the flag (``what``), the module or file and what to change; a module under one of
    this project's package names (``reward.mine``) is said to be shadowed by ours."""
    text = str(path).strip()
    if ".py:" in text or text.endswith(".py") or os.sep in text.partition(":")[0]:
        return _load_from_file(text, what)
    module, sep, name = text.replace(":", ".").rpartition(".")
    if not sep or not module or not name:
        raise ValueError(
            f"{what} {path}: must look like 'package.module.function' (a module's import path, then the function) "
            "or 'path/to/file.py:function'"
        )
    top = module.partition(".")[0]
    clash = (f"; note: {top!r} is also this project's own package ({top}/), which shadows a package of yours of "
             f"that name: rename yours, or give its file: {what} path/to/{module.replace('.', '/')}.py:{name}"
             if top in OUR_PACKAGES else "")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        searched = [p for p in sys.path if p] or ["(empty)"]
        raise ValueError(
            f"{what} {path}: cannot import module {module!r}: {e}; searched (in order): {', '.join(searched)}. "
            "Run relay from the directory that contains the module's top-level package, or add that "
            f"directory to PYTHONPATH ({USER_PATH_ENV} is the directory searched first){clash}"
        ) from None
    except Exception as e:  # the module itself failed while importing (a bug in user code)
        raise ValueError(f"{what} {path}: importing module {module!r} raised {type(e).__name__}: {e}") from e
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(
            f"{what} {path}: module {module!r} ({getattr(mod, '__file__', '?')}) has no function {name!r}{clash}")
    return fn


def _load_from_file(text: str, what: str) -> Callable:
    """``path/to/file.py:func``: the file's module (loaded once per file, under a name of its own
    that cannot clash with an installed package) and its function."""
    file, sep, name = text.rpartition(":")
    if not sep or not file.endswith(".py") or not name.isidentifier():
        raise ValueError(f"{what} {text}: a file is given as 'path/to/file.py:function'")
    base = reward_settings().user_path or os.getcwd()
    full = os.path.abspath(os.path.join(base, os.path.expanduser(file)))
    if not os.path.isfile(full):
        raise ValueError(f"{what} {text}: no file {full} (a relative path is taken from {base})")
    key = "relay_user_code." + hashlib.sha1(full.encode()).hexdigest()[:12]
    mod = sys.modules.get(key)
    if mod is None:
        spec = importlib.util.spec_from_file_location(key, full)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        try:
            spec.loader.exec_module(mod)
        except Exception as e:  # a bug in the user's file
            del sys.modules[key]
            raise ValueError(f"{what} {text}: loading {full} raised {type(e).__name__}: {e}") from e
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"{what} {text}: {full} has no function {name!r}")
    return fn


def make_reward_fn(cfg, judge: Callable[[list], Awaitable[str]] | None = None,
                   judge_address: str | None = None) -> RewardFn:
    """The per-sample reward for a config. ``dapo-genrm`` reaches the judge service at
    ``judge_address`` (its relay address; without one, ``RELAY_GENRM_ADDR``); ``judge``
    overrides the judge client (tests)."""
    sem = asyncio.Semaphore(cfg.reward_max_concurrency)
    if cfg.custom_rm_path:
        fn = load_callable(cfg.custom_rm_path, "--custom-rm-path")

        async def custom(sample: dict):
            # ``fn(args, sample)``: a function of the original's signature ``(args, sample,
            # **kwargs)`` and one of ours ``(args, sample)`` alike; sync or async
            out = fn(cfg, sample)
            return await out if inspect.isawaitable(out) else out

        inner: RewardFn = custom
    elif cfg.rm_type == "dapo":

        async def dapo(sample: dict):
            return math_grader.grade(sample.get("response", ""), str(sample.get("label", "")))

        inner = dapo
    elif cfg.rm_type == "math-verify":
        math_verify_grader.require()  # missing package: fail when the reward is made, not per sample

        async def math_verify(sample: dict):
            return math_verify_grader.grade(sample.get("response", ""), str(sample.get("label", "")))

        inner = math_verify
    elif cfg.rm_type == "dapo-genrm":
        inner = judge_reward(cfg, judge, judge_address)
    elif cfg.rm_type == "dummy":

        async def dummy(sample: dict):
            return {cfg.reward_key: 0.0} if cfg.reward_key else 0.0

        inner = dummy
    else:
        raise ValueError("no reward: set --rm-type (dapo, dapo-genrm, dummy, math-verify) "
                         "or --custom-rm-path module.func")

    async def bounded(sample: dict):
        async with sem:
            return await inner(sample)

    return bounded


def judge_reward(cfg, judge: Callable[[list], Awaitable[str]] | None = None, judge_address: str | None = None,
                 route_key: str | None = None, sampling_params: dict | None = None) -> RewardFn:
    """``--rm-type dapo-genrm``'s reward of one sample (reward/dapo_genrm.py), with the
    config's prompt, answer guard, parsing and variant, asking the judge ``judge`` (else the
    judge client at ``judge_address``, for the instance ``route_key``: None is the default
    one; ``sampling_params`` over the instance's) and reporting each verdict's parse to the
    service. The self-check (reward/integrity.py) asks every instance through this same
    path, greedily."""

    async def genrm(sample: dict):
        j, report = judge, None
        if j is None:
            from .client import get_genrm_client

            client = get_genrm_client(judge_address)
            j = functools.partial(client.generate, sampling_params=sampling_params, route_key=route_key)
            report = functools.partial(client.report_parse, route_key)
        return await dapo_genrm.score(
            sample, j, parse=cfg.genrm_parse, report=report, template=getattr(cfg, "genrm_prompt_template", None),
            variant=getattr(cfg, "genrm_reward_variant", "documented"), guard=getattr(cfg, "genrm_answer_guard", True),
        )

    return genrm


def reward_value(result: Any, reward_key: str | None) -> float:
    """The number the trainer uses: the float itself, or ``result[reward_key]`` (default "score")."""
    if isinstance(result, dict):
        key = reward_key or "score"
        if key not in result:
            raise KeyError(f"reward dict has no key {key!r} (keys: {sorted(result)}); set --reward-key")
        return float(result[key])
    return float(result)


def load_post_process(cfg) -> Callable[..., Awaitable[tuple]] | None:
    """The ``--custom-reward-post-process-path`` hook ``(args, samples) -> (raw, normalized)``,
    as an async function whether the hook is sync or async. A sync hook (the original calls
    its hook synchronously) runs in a worker thread, so it may block, or run its own event
    loop (``asyncio.run``), without stalling the loop that runs the job."""
    if not cfg.custom_reward_post_process_path:
        return None
    hook = load_callable(cfg.custom_reward_post_process_path, "--custom-reward-post-process-path")
    if inspect.iscoroutinefunction(hook):
        return hook

    async def run_hook(args, samples):
        out = await asyncio.to_thread(hook, args, samples)
        return await out if inspect.isawaitable(out) else out

    run_hook.hook = hook  # the user's function, for messages and tests
    return run_hook
