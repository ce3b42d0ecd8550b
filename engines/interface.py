"""The inference-engine contract shared by the built-in torch engine and the SGLang adapter.

Log-probabilities (one definition, used by engines and the trainer): the log-probability of
each chosen token under ``softmax(logits / T)`` where ``T`` is the request's temperature
(``T = 1`` for greedy, temperature 0), *before* top-k / top-p / min-p truncation. With
penalties (``repetition_penalty``, ``frequency_penalty``, ``presence_penalty``,
``min_new_tokens``) the logits are the penalized ones the token was drawn from, as SGLang
reports them; without them (the defaults) they are the model's own.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import functools
import math
from dataclasses import dataclass, field

import relay

TAGS = ("weights", "kv_cache", "cuda_graph")


#: The engine options the launcher gives every engine, whatever its backend (docs/engines.md,
#: "Engine options"): ``device`` ("cpu" | "cuda"); ``weights_mode`` ("discard": a rollout
#: engine, whose weights are re-synced after a sleep; "backup": a judge, whose weights
#: survive a sleep in CPU memory); ``offload`` (it sleeps to make room for co-tenants);
#: ``mem_fraction_static``; ``kv_cache_tokens`` (the KV size in tokens, how CPU runs size
#: it); ``gpu_ids`` (the node's GPU ids the engine spans, first = its base GPU);
#: ``engine_config`` (the per-engine config dict: dp/pp/ep sizes, context length and
#: backend-specific keys).
ENGINE_OPTIONS = ("device", "weights_mode", "offload", "mem_fraction_static", "kv_cache_tokens", "gpu_ids",
                  "engine_config")


def backend_options(backend: str, options: dict) -> dict:
    """``options`` (keys of ENGINE_OPTIONS, plus a backend's own tuning keys) as ``backend``'s
    constructor takes them. The SGLang adapter takes them all (``engines.sglang.args``). The
    built-in engine can always sleep and spans several GPUs through follower ranks the
    launcher starts in those GPUs' workers (``tp_peers``, passed on), so it takes no
    ``gpu_ids``; ``offload`` (a colocated engine: the GPU's trainer and other engines share
    its worker process) becomes ``lend_kv=True`` (engines/kv_pool.py); of
    ``engine_config`` it takes ``max_context_len`` (judges)
    and ``ep_size`` (a MoE model's expert-parallel groups; 1 where it does not divide the
    engine's ``gpu_ids``) as its own arguments (``kv_cache_tokens`` and ``dp_size`` are
    resolved by the launcher)."""
    options = dict(options)
    if backend == "sglang":
        return options
    gpus = options.pop("gpu_ids", None)
    if options.pop("offload", False):  # colocated: the GPU's trainer and other engines share this worker
        options.setdefault("lend_kv", True)
    engine_config = options.pop("engine_config", None) or {}
    for key in ("max_context_len", "ep_size"):
        if key in engine_config:
            options.setdefault(key, engine_config[key])
    if gpus and len(gpus) % options.get("ep_size", 1):
        options["ep_size"] = 1  # a replica of fewer GPUs than ep_size: no expert parallelism (the job check warns)
    return options


#: Limits of SamplingParams.validate (docs/engines.md).
GREEDY_BELOW = 1e-5
MAX_INT32 = 2**31 - 1
MAX_INT64 = 2**63 - 1
MAX_NEW_TOKENS = 1 << 20
MAX_STOPS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_N = 128  # samples per request (as OpenAI's n); fanned out by generate_n


def short_repr(value, limit: int = 40) -> str:
    """A short, safe rendering of a user value for an error message."""
    text = repr(value)
    return (text[:limit] + f"... ({len(text)} characters)") if len(text) > limit else text


#: float32's largest finite value: a sampling value past it becomes inf on the device (NaN
#: after a division) and fails the whole engine step. (Values too small for float32 read as
#: 0: harmless for top_p, min_p and the penalties, which the engine handles; the repetition
#: penalty, which divides, has its own floor.)
FLOAT32_MAX = 3.0e38
#: the smallest repetition penalty: positive logits are divided by it and must stay finite in
#: float32 (1e-40 read as 0 and failed the whole step)
MIN_REPETITION_PENALTY = 1e-30


def _number(name: str, value, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be {allowed}, got {short_repr(value)} ({type(value).__name__})")
    try:
        v = float(value)
    except OverflowError:  # an integer past float64's range
        raise ValueError(f"{name} must be {allowed}; got an integer of {value.bit_length()} bits") from None
    if not math.isfinite(v) or abs(v) > FLOAT32_MAX:
        raise ValueError(f"{name} must be {allowed} that float32 holds (at most {FLOAT32_MAX:g} in size), "
                         f"got {short_repr(value)}")
    return v


def _integer(name: str, value, allowed: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be {allowed}, got {short_repr(value)} ({type(value).__name__})")
    if not -MAX_INT64 - 1 <= value <= MAX_INT64:
        raise ValueError(f"{name} must be {allowed}; got an integer of {value.bit_length()} bits (more than 64)")
    return value


#: SGLang's constrained-decoding keys, and their longest accepted value
CONSTRAINTS = ("regex", "json_schema", "ebnf")
MAX_CONSTRAINT_CHARS = 64 * 1024


@relay.register(name="engines.SamplingParams")
@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop: list = field(default_factory=list)  # strings
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    # SGLang's further keys, with its meaning and defaults (docs/engines.md); the defaults
    # change nothing.
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_new_tokens: int = 0
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    # SGLang's constrained decoding (at most one): passed to SGLang engines; the built-in
    # engine refuses a request that sets one (it cannot constrain its output)
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None

    @functools.cached_property  # read for every row of every step; the fields are not changed after validation
    def penalized(self) -> bool:
        """Whether the logits are changed before sampling (a penalty or min_new_tokens)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.min_new_tokens > 0)

    def validate(self) -> SamplingParams:
        """Check every field's exact type and range, so that no value reaching an engine can
        break its step or the batch it travels in (a bool is not a number, numbers are finite,
        integers fit the sampler's int64, lists and strings are bounded). Raises ValueError
        naming the field and what is allowed (echoing at most a short prefix of the value).
        A temperature below ``GREEDY_BELOW`` means greedy (as in SGLang): it becomes 0."""
        t = _number("temperature", self.temperature, "a finite number >= 0 (0: greedy)")
        if t < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {short_repr(t)}")
        self.temperature = 0.0 if t < GREEDY_BELOW else t
        p = _number("top_p", self.top_p, "a number in (0, 1]")
        if not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {short_repr(p)}")
        k = _integer("top_k", self.top_k, "-1 (off) or an integer >= 1")
        if k == 0 or k < -1 or k > MAX_INT32:
            raise ValueError(f"top_k must be -1 (off) or an integer in [1, {MAX_INT32}], got {short_repr(k)}")
        n = _integer("max_new_tokens", self.max_new_tokens, f"an integer in [1, {MAX_NEW_TOKENS}]")
        if not 1 <= n <= MAX_NEW_TOKENS:
            raise ValueError(
                f"max_new_tokens (max_response_len) must be an integer in [1, {MAX_NEW_TOKENS}], got {short_repr(n)}"
            )
        if isinstance(self.stop, str):  # one stop string, as SGLang and OpenAI accept
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or len(self.stop) > MAX_STOPS:
            raise ValueError(
                f"stop must be a string or a list of at most {MAX_STOPS} strings, got {short_repr(self.stop)}"
            )
        for s in self.stop:
            if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
                raise ValueError(
                    f"stop: each entry must be a non-empty string of at most {MAX_STOP_CHARS} characters, got "
                    f"{short_repr(s)}"
                )
        if not isinstance(self.stop_token_ids, list) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids, got "
                f"{short_repr(self.stop_token_ids)}"
            )
        for i in self.stop_token_ids:
            if _integer("stop_token_ids", i, "token ids (integers >= 0)") < 0 or i > MAX_INT32:
                raise ValueError(
                    f"stop_token_ids: each entry must be an integer in [0, {MAX_INT32}], got {short_repr(i)}"
                )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {short_repr(self.ignore_eos)}")
        if self.seed is not None and not 0 <= _integer("seed", self.seed, "an integer >= 0, or null") <= MAX_INT64:
            raise ValueError(f"seed must be an integer in [0, {MAX_INT64}] or null, got {short_repr(self.seed)}")
        self._validate_sglang_keys()
        return self

    def _validate_sglang_keys(self) -> None:
        """The ranges SGLang's ``SamplingParams.verify`` accepts (repetition_penalty > 0: it
        divides by it), with exact types."""
        self.min_p = _number("min_p", self.min_p, "a number in [0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {short_repr(self.min_p)}")
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty, "a number in (0, 2]")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2:
            raise ValueError(
                f"repetition_penalty must be in (0, 2] and at least {MIN_REPETITION_PENALTY:g} (1: off; logits are "
                f"divided by it), got {short_repr(self.repetition_penalty)}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            v = _number(name, getattr(self, name), "a number in [-2, 2]")
            if not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0: off), got {short_repr(v)}")
            setattr(self, name, v)
        m = _integer("min_new_tokens", self.min_new_tokens, "an integer >= 0")
        if not 0 <= m <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}], got {short_repr(m)}"
            )
        for name in ("skip_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {short_repr(getattr(self, name))}")
        n = _integer("n", self.n, f"an integer in [1, {MAX_N}]")
        if not 1 <= n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {short_repr(n)}")
        constraints = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        for name in constraints:
            value = getattr(self, name)
            if not isinstance(value, str) or not 0 < len(value) <= MAX_CONSTRAINT_CHARS:
                raise ValueError(f"{name} must be a non-empty string of at most {MAX_CONSTRAINT_CHARS} characters, "
                                 f"got {short_repr(value)}")
        if len(constraints) > 1:
            raise ValueError(f"at most one of regex, json_schema, ebnf; got {', '.join(constraints)}")

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        if d is not None and not isinstance(d, dict):
            raise ValueError(f"sampling parameters must be an object, got {short_repr(d)}")
        d = dict(d or {})
        if "max_response_len" in d and "max_new_tokens" not in d:
            d["max_new_tokens"] = d.pop("max_response_len")
        d.pop("max_response_len", None)
        d.pop("chat_template_kwargs", None)
        unknown = set(d) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"unknown sampling parameters {sorted(unknown)}")
        return cls(**d).validate()


def checked_sampling(sampling) -> SamplingParams:
    """The validated parameters of one engine request (``Engine.generate``): a dict or
    SamplingParams, with ``n == 1``. An engine returns one GenerateResult per request, so
    ``n > 1`` is refused here; the layer that answers the user fans out (:func:`generate_n`)."""
    sp = sampling if isinstance(sampling, SamplingParams) else SamplingParams.from_dict(sampling)
    sp.validate()
    if sp.n != 1:
        raise ValueError(
            f"n must be 1 for one engine request, got {sp.n}: an engine returns one sample per request; "
            "send n requests (engines.interface.generate_n / fan_out)"
        )
    return sp


def fan_out(sampling: SamplingParams | dict | None) -> list[SamplingParams]:
    """The ``n`` one-sample requests of a request for ``n`` samples: copies with ``n = 1``,
    the j-th seeded with ``seed + j`` (mod 2^63) when the request has a seed, so the samples
    differ and each is reproducible; unseeded ones stay unseeded (independent draws)."""
    sp = sampling if isinstance(sampling, SamplingParams) else SamplingParams.from_dict(sampling)
    sp.validate()
    seed = sp.seed
    return [
        dataclasses.replace(sp, n=1, stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids),
                            seed=None if seed is None else (seed + j) % (MAX_INT64 + 1))
        for j in range(sp.n)
    ]


async def generate_n(engine, prompt, sampling=None, chat_template_kwargs: dict | None = None) -> list:
    """``sampling.n`` samples of ``prompt`` from ``engine`` (its :func:`fan_out` requests, sent
    together: the torch engine prefills a prompt admitted with identical ones once and shares
    its KV). One GenerateResult per sample, in order; the first failure is raised."""
    return list(await asyncio.gather(*(engine.generate(prompt, sp, chat_template_kwargs)
                                        for sp in fan_out(sampling))))


@relay.register(name="engines.EngineStepError")
class EngineStepError(RuntimeError):
    """An engine step failed (not the request's fault: e.g. out of memory): the requests of
    that step failed with it, and the engine recovered and serves on. Callers may retry.
    (The built-in engine runs such requests again apart instead: :class:`RequestFault`.)"""


@relay.register(name="engines.RequestFault")
class RequestFault(ValueError):
    """This request failed an engine step on its own (a step with no other request in it,
    after failing one before): it is refused, like a bad value (HTTP 400); the requests that
    ran with it ran again without it."""


@relay.register(name="engines.EngineFailed")
class EngineFailed(RuntimeError):
    """The engine cannot go on (its steps kept failing after recovery): it serves no more
    requests until it is rebuilt. Send the request to another engine."""


@relay.register(name="engines.RequestCancelled")
class RequestCancelled(RuntimeError):
    """The request was cancelled by its caller before it finished."""


@relay.register(name="engines.GenerateResult")
@dataclass
class GenerateResult:
    token_ids: list
    text: str
    logprobs: list  # one per generated token (see the module docstring)
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    weight_version: int  # the weights of the request's start (a weight update mid-request keeps the older)


class Engine(abc.ABC):
    """Async inference engine. ``sleep``/``wake`` are idempotent; sleeping with requests in
    flight first drains them (``drain="abort"`` aborts them, ``"finish"`` lets them end)."""

    @abc.abstractmethod
    async def generate(
        self, prompt, sampling: SamplingParams | dict | None = None, chat_template_kwargs: dict | None = None
    ) -> GenerateResult: ...

    @abc.abstractmethod
    async def sleep(self, tags=TAGS, drain: str = "abort") -> None: ...

    @abc.abstractmethod
    async def wake(self, tags=TAGS) -> None: ...

    @abc.abstractmethod
    async def update_weights(self, buckets, version: int) -> None: ...

    @abc.abstractmethod
    async def pause(self) -> None: ...

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @abc.abstractmethod
    async def abort(self, request_ids=None) -> int: ...

    @abc.abstractmethod
    async def health(self) -> dict: ...

    @abc.abstractmethod
    async def stats(self) -> dict: ...

    async def close(self) -> None:  # noqa: B027 (optional)
        """Release everything (processes, memory)."""

    # Weight sync beyond ``update_weights`` (:mod:`engines.weight_sync`): CUDA IPC from a
    # trainer on the same GPU, and a broadcast group with trainer rank 0. A backend without
    # them takes weights through ``update_weights`` (the trainer's sender routes it there).

    def weight_sync_info(self) -> dict:
        """``{"backend", "device_type", "uuid", ...}``: lets the trainer choose a transport."""
        return {"backend": type(self).__name__, "device_type": "cpu", "uuid": None}

    async def update_weights_from_ipc(self, handle: dict | list, metas: list, version: int, last: bool = True) -> None:
        raise NotImplementedError(_no_transport(self, "CUDA IPC"))

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> None:
        raise NotImplementedError(_no_transport(self, "a broadcast group"))

    async def update_weights_from_distributed(
        self, names: list, dtypes: list, shapes: list, version: int, group_name: str, last: bool = True
    ) -> None:
        raise NotImplementedError(_no_transport(self, "a broadcast group"))

    async def destroy_weights_update_group(self, group_name: str) -> None:
        raise NotImplementedError(_no_transport(self, "a broadcast group"))


def _no_transport(engine: Engine, what: str) -> str:
    return (
        f"{type(engine).__name__} takes no weights by {what}: it takes them through update_weights "
        "(the trainer's weight sender routes it there)"
    )


def check_tags(tags) -> tuple[str, ...]:
    tags = (tags,) if isinstance(tags, str) else tuple(tags)
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise ValueError(f"unknown memory tags {bad}; tags are {', '.join(TAGS)}")
    return tags


def encode_rendered(tokenizer, texts: list) -> list[list[int]]:
    """Token ids of chats already rendered by their chat template, as
    ``apply_chat_template(tokenize=True)`` gives them (no special tokens added: the template
    wrote them). A fast tokenizer encodes the whole batch at once, without offsets."""
    if not all(isinstance(t, str) for t in texts):
        raise TypeError("rendered prompts must be strings")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    if len(texts) == 1:
        return [backend.encode(texts[0], add_special_tokens=False).ids]
    return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
