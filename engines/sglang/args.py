"""The SGLang server's command line, computed from the engine options every backend takes
(``engines.interface.ENGINE_OPTIONS``), as the original computes it (reference: relax
``_compute_genrm_server_args`` and slime ``_compute_server_args``), and the pinned SGLang
version's protocol record (``engines/sglang/protocol.json``: its server arguments, HTTP
routes and request keys; written by ``scripts/sglang_protocol.py`` from the wheel).

Nothing here imports SGLang (it is CUDA-only): the adapter runs ``python -m
sglang.launch_server`` with these arguments and checks every request against the record.
"""

from __future__ import annotations

import functools
import json
import os
import sys

#: Engine-config keys of the original (and of relay) that are not SGLang server arguments
#: but mean one: ``max_context_len`` (relax's key) is ``context_length``; ``kv_cache_tokens``
#: (relay's KV size) is SGLang's ``max_total_tokens``.
RENAMED = {"max_context_len": "context_length", "kv_cache_tokens": "max_total_tokens"}
#: Server arguments the adapter sets to reach its own server: an engine config cannot change them.
OWN = ("model_path", "host", "port")


@functools.lru_cache(maxsize=1)
def protocol() -> dict:
    """The pinned SGLang version's record (``sglang_version``, ``server_args``, ``routes``,
    ``requests``, ``sampling_params``)."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "protocol.json")) as f:
        return json.load(f)


def check_request(route: str, body: dict | None) -> None:
    """Raise ValueError if ``route`` is not a route of the pinned version or ``body`` has a
    key its request type does not take (SGLang would refuse it with 422)."""
    record = protocol()
    path = route.split("?", 1)[0]
    if path not in record["routes"]:
        raise ValueError(f"sglang {record['sglang_version']} has no route {path!r}")
    allowed = record["requests"].get(path, ())  # a route without a request type takes no body keys
    if body:
        unknown = sorted(set(body) - set(allowed))
        if unknown:
            raise ValueError(f"sglang {record['sglang_version']} {path} takes no {', '.join(unknown)}")
    if path == "/generate" and body and body.get("sampling_params"):
        unknown = sorted(set(body["sampling_params"]) - set(record["sampling_params"]))
        if unknown:
            raise ValueError(f"sglang {record['sglang_version']} SamplingParams takes no {', '.join(unknown)}")


def _flags(fields: dict) -> list[str]:
    """ServerArgs fields -> argv, each with the pinned version's own flag (a switch is
    given when true and left out when false)."""
    spec = protocol()["server_args"]
    argv: list[str] = []
    for name, value in fields.items():
        flag = spec[name]["flag"]
        if spec[name]["kind"] == "switch":
            if value:
                argv.append(flag)
        elif value is not None:
            text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
            argv += [flag, text]
    return argv


def server_fields(
    model_path: str,
    port: int,
    *,
    device: str = "cuda",
    weights_mode: str = "backup",
    offload: bool = False,
    mem_fraction_static: float | None = None,
    kv_cache_tokens: int | None = None,
    gpu_ids: list | None = None,
    engine_config: dict | None = None,
    warn=None,
) -> dict:
    """The ServerArgs of one engine (field -> value, in the order given on the command line):

    - ``tp_size`` = the engine's GPUs (``gpu_ids``) / ``pp_size``; ``dp_size``, ``pp_size``,
      ``ep_size`` from the engine config (default 1); ``dp_size`` > 1 is data-parallel attention
      inside the engine (``enable_dp_attention`` unless the config says otherwise; it must
      divide ``tp_size``); ``base_gpu_id`` = its first GPU (node
      numbering; the server sees the node's GPUs), ``gpu_id_step`` 1;
    - ``mem_fraction_static`` (the plan's share; an engine-config value overrides it);
    - ``enable_memory_saver`` when the engine releases memory (``offload``: colocated with
      the trainer or another role; then also ``cuda_graph_backend_prefill="disabled"``, as
      slime sets it: the breakable prefill graph does not survive the saver), and ``enable_weights_cpu_backup`` for
      ``weights_mode="backup"`` (judges: their weights survive a release; a rollout engine,
      ``"discard"``, is refilled by weight sync);
    - ``context_length`` (engine config ``max_context_len`` or ``context_length``),
      ``max_total_tokens`` (``kv_cache_tokens``, the KV size in tokens);
    - every other engine-config key that is a ServerArgs field of the pinned version is
      applied last, as given; unknown keys (and ``model_path``/``host``/``port``, the
      adapter's own) are dropped with a warning (``warn(text)``).
    """
    if weights_mode not in ("discard", "backup"):
        raise ValueError("weights_mode must be 'discard' (rollout: re-synced after wake) or 'backup' (judge)")
    spec = protocol()["server_args"]
    config = dict(engine_config or {})
    for old, new in RENAMED.items():
        if old in config:
            value = config.pop(old)
            config.setdefault(new, value)
    if kv_cache_tokens is not None:
        config.setdefault("max_total_tokens", kv_cache_tokens)
    for key in ("dp_size", "pp_size", "ep_size"):
        value = config.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"engine config {key} must be an integer >= 1, got {value!r}")
    gpus = list(gpu_ids) if gpu_ids else [0]
    pp = config.get("pp_size", 1)
    if len(gpus) % pp:
        raise ValueError(f"an engine of {len(gpus)} GPUs cannot run pp_size {pp}: it must divide the GPU count")
    dp = config.get("dp_size", 1)
    if dp > 1:  # data-parallel attention inside the one tensor-parallel engine (the 397B judge: TP = DP = EP = 8)
        if (len(gpus) // pp) % dp:
            raise ValueError(f"dp_size {dp} (data-parallel attention) must divide the engine's tensor-parallel size "
                             f"{len(gpus) // pp} (its GPUs / pp_size)")
        config.setdefault("enable_dp_attention", True)
    fields = {
        "model_path": model_path,
        "host": "127.0.0.1",
        "port": port,
        "device": device,
        "tp_size": len(gpus) // pp,
        "dp_size": config.pop("dp_size", 1),
        "pp_size": config.pop("pp_size", 1),
        "ep_size": config.pop("ep_size", 1),
        "base_gpu_id": gpus[0],
        "gpu_id_step": 1,
        "mem_fraction_static": config.pop("mem_fraction_static", mem_fraction_static),
        "context_length": config.pop("context_length", None),
        "max_total_tokens": config.pop("max_total_tokens", None),
        "enable_memory_saver": offload,
        # slime: the breakable prefill CUDA graph (0.5.15's default on CUDA) does not work under the memory saver
        "cuda_graph_backend_prefill": "disabled" if offload else None,
        "enable_weights_cpu_backup": weights_mode == "backup",
        "skip_server_warmup": True,  # the adapter waits on /health_generate itself
    }
    for key, value in config.items():
        if key in OWN:
            (warn or _stderr)(f"engine config key {key!r} is set by relay (the adapter's own server); dropped")
        elif key in spec:
            fields[key] = value
        else:
            message = (f"engine config key {key!r} is not a server argument of sglang "
                       f"{protocol()['sglang_version']}; dropped")
            (warn or _stderr)(message)
    return fields


def server_env(gpu_ids: list | None, offload: bool, base: dict | None = None) -> dict:
    """The server's environment: it sees the node's GPUs up to the engine's last
    (``base_gpu_id`` counts in node numbering); ``PYTORCH_CUDA_ALLOC_CONF`` is dropped
    (SGLang's memory saver does not take expandable segments); under the memory saver
    CUDA graphs are released with the rest (``SGLANG_MEMORY_SAVER_CUDA_GRAPH``)."""
    env = dict(os.environ if base is None else base)
    gpus = list(gpu_ids) if gpu_ids else [0]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(max(gpus) + 1))
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(key, None)
    if offload:
        env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] = "true"
    return env


def server_argv(fields: dict) -> list[str]:
    return _flags(fields)


def _stderr(message: str) -> None:
    print(f"relay: {message}", file=sys.stderr, flush=True)


def version_problem(launch_module: str) -> str | None:
    """Why the SGLang that ``launch_module`` starts is not the recorded version this adapter
    speaks (engines/sglang/protocol.json), or None. A stand-in server (another module, as the
    tests' fake) is not checked."""
    from importlib import metadata

    if launch_module != "sglang.launch_server":
        return None
    recorded = protocol()["sglang_version"]
    try:
        installed = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return f"sglang is not installed: pip install 'relay-rl[sglang]' (sglang=={recorded})"
    if installed != recorded:
        return (f"sglang {installed} is installed, but this adapter speaks sglang {recorded} (its server arguments, "
                f"routes and request keys: engines/sglang/protocol.json): pip install 'sglang=={recorded}', or record "
                f"the installed version with scripts/sglang_protocol.py and test it")
    return None
