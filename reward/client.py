"""The judge client for reward code, over relay (ZeroMQ):

    from reward.client import get_genrm_client
    client = get_genrm_client()          # address from RELAY_GENRM_ADDR (set by the launcher)
    text = await client.generate(messages, sampling_params=None, route_key=None)
    texts = await client.generate_many([messages_a, messages_b])

One client per process and event loop (``get_genrm_client`` caches it). Errors are typed:
:class:`~reward.errors.JudgeAsleep` at once while the judge sleeps (no waiting on a sleeping
judge), ``ValueError`` / :class:`~reward.errors.UnknownRouteKey` for bad requests (never
retried), :class:`~reward.errors.JudgeEngineError` when engine steps failed the request in
all the service's attempts (3, with backoff; not retried again here),
:class:`~reward.errors.JudgeUnavailable` after bounded retries of transport failures.
Cancelling a call (its task) cancels the request in the service and in its engine. Outside
a job, pass ``address`` and give the process the judge's secret (``RELAY_JOB_SECRET``, or
``RELAY_JOB_SECRET_FILE`` naming the file ``relay judge`` printed).

The first call proves the secret with relay's authenticated handshake
(``ProcMesh.authenticate``): a wrong or missing secret raises
:class:`relay.AuthenticationError`, which says what to set, within seconds (not after the
call timeout); it is never retried.

Calls made in the same event-loop turn (concurrent reward coroutines, ``generate_many``)
travel to the service as one relay message (:class:`JudgeBatcher`); each call still gets
its own result, error and timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid

import relay
from engines.interface import SamplingParams
from relay import ActorError, AuthenticationError, CallTimeout, ProcMesh, ProcRef, SupervisionError

from .errors import JudgeAsleep, JudgeEngineError, JudgeUnavailable
from .judge import JudgeService
from .protocol import check_request

ENV_ADDR = "RELAY_GENRM_ADDR"
ENV_ACTOR = "RELAY_GENRM_ACTOR"
MAX_BATCH = 256  # judge requests per relay message to the service


class JudgeBatcher:
    """Coalesces judge requests to one JudgeService mesh: the requests submitted during one
    event-loop turn with the same timeout go out at its end as one ``generate_batch`` call
    (up to ``MAX_BATCH``), whose timeout is theirs.

    Each request's future gets its own outcome, as a lone ``generate.call_one`` would give
    it: the response text; :class:`ActorError` wrapping the exception the service raised for
    that request; or, when the relay call itself fails, that failure (SupervisionError,
    CallTimeout) for every request of the call.
    """

    def __init__(self, mesh):
        self._mesh = mesh
        self._queues: dict[float, list] = {}  # timeout -> [(request, future)] of this loop turn
        self._prefix = uuid.uuid4().hex[:12] + ":"  # request ids unique across clients
        self._ids = itertools.count()
        self._cancelled: list = []  # ids of sent requests whose callers gave up, this loop turn

    def call(self, messages, sampling_params, route_key, timeout: float) -> asyncio.Future:
        """The future of one request's outcome. Cancelling it (its caller gave up, or was
        cancelled) cancels the request in the service and its engine."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        queue = self._queues.get(timeout)
        if queue is None:
            queue = self._queues[timeout] = []
            if len(self._queues) == 1:
                loop.call_soon(self._flush)
        queue.append(([messages, sampling_params, route_key, f"{self._prefix}{next(self._ids):x}"], fut))
        return fut

    def _flush(self) -> None:
        queues, self._queues = self._queues, {}
        loop = asyncio.get_running_loop()
        for timeout, queue in queues.items():
            queue = [(req, f) for req, f in queue if not f.done()]  # cancelled before they went out
            for k in range(0, len(queue), MAX_BATCH):
                loop.create_task(self._send(queue[k : k + MAX_BATCH], timeout))

    def _cancel(self, request_id: str) -> None:
        if not self._cancelled:
            asyncio.get_running_loop().call_soon(self._send_cancels)
        self._cancelled.append(request_id)

    def _send_cancels(self) -> None:
        ids, self._cancelled = self._cancelled, []
        self._mesh.cancel.broadcast(ids)  # fire and forget

    async def _send(self, batch: list, timeout: float) -> None:
        futures = [f for _, f in batch]
        for req, fut in batch:
            fut.add_done_callback(lambda f, rid=req[3]: self._cancel(rid) if f.cancelled() else None)
        try:
            results = await self._mesh.generate_batch.call_one([req for req, _ in batch]).result(timeout)
            if len(results) != len(futures):
                raise ValueError(f"the judge service answered {len(results)} results for {len(futures)} requests")
        except BaseException as e:  # noqa: BLE001 - the call itself failed: every request gets it
            if isinstance(e, CallTimeout):  # nobody waits for them any more
                for req, fut in batch:
                    if not fut.done():
                        self._cancel(req[3])
            for fut in futures:
                if not fut.done():
                    fut.set_exception(e)
            return
        for fut, r in zip(futures, results):
            if fut.done():
                continue
            if isinstance(r, BaseException):  # that request's own error, as a lone call raises it
                fut.set_exception(ActorError("genrm", 0, "generate", r, getattr(r, "remote_traceback", "")))
            else:
                fut.set_result(r)


class GenRMClient:
    def __init__(
        self, address: str, actor: str = "genrm", timeout: float = 600.0, retries: int = 2, auth_timeout: float = 5.0
    ):
        self.address = address
        self.timeout = timeout
        self.retries = retries
        self.auth_timeout = auth_timeout
        self._procs = ProcMesh.attach([ProcRef("genrm", address, "genrm", 0)], name="genrm")
        self._mesh = self._procs.actors(actor, JudgeService)
        self._batcher = JudgeBatcher(self._mesh)
        self._authenticated = False
        self._auth: asyncio.Future | None = None  # the handshake in progress, shared by concurrent calls

    async def _authenticate(self) -> None:
        """One handshake for all calls waiting on it; a failed one is tried again by the next call."""
        if self._auth is None:
            self._auth = asyncio.ensure_future(self._handshake())
        auth = self._auth
        try:
            await asyncio.shield(auth)
        finally:
            if auth.done() and self._auth is auth and (auth.cancelled() or auth.exception() is not None):
                self._auth = None

    async def _handshake(self) -> None:
        try:
            await self._procs.authenticate(self.auth_timeout)
        except AuthenticationError as e:
            raise AuthenticationError(
                e.addr,
                f"judge client: {e} `relay judge` prints the file that holds its secret: use "
                f"RELAY_JOB_SECRET_FILE=<that file>.",
            ) from None
        self._authenticated = True

    async def generate(
        self,
        messages: list,
        sampling_params: dict | None = None,
        route_key: str | None = None,
        timeout: float | None = None,
    ) -> str:
        # a bad request fails this call alone, here, before it is batched with other calls
        # (an integer past 64 bits, or nesting deeper than msgpack packs, would make the whole
        # batch's message unsendable)
        check_request(messages, sampling_params, route_key)
        SamplingParams.from_dict(sampling_params)
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                if not self._authenticated:
                    await self._authenticate()
                return await self._batcher.call(messages, sampling_params, route_key, timeout or self.timeout)
            except ActorError as e:
                if isinstance(e.exception, JudgeUnavailable):
                    last = e.exception
                elif isinstance(e.exception, (JudgeAsleep, JudgeEngineError, ValueError, TypeError)):
                    raise e.exception from None
                else:
                    raise
            except (SupervisionError, CallTimeout) as e:
                last = e
            await asyncio.sleep(0.5 * (attempt + 1))
        raise JudgeUnavailable(f"judge at {self.address} failed {self.retries + 1} times: {last}")

    def report_parse(self, route_key: str | None, ok: bool) -> None:
        """Tell the service whether a verdict could be read (fire and forget; feeds the
        parse-failure rate in its metrics)."""
        self._mesh.record_parse.broadcast(route_key, ok)

    async def generate_many(
        self, list_of_messages: list, sampling_params: dict | None = None, route_key: str | None = None
    ) -> list[str]:
        return list(await asyncio.gather(*(self.generate(m, sampling_params, route_key) for m in list_of_messages)))


_clients: dict = {}


def get_genrm_client(address: str | None = None, actor: str | None = None) -> GenRMClient:
    """The client of this process and event loop (created on first use)."""
    address = address or relay.settings().genrm_addr
    if not address:
        raise RuntimeError(f"no judge address: pass address=... or run inside a job (which sets {ENV_ADDR})")
    actor = actor or relay.settings().genrm_actor
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    key = (os.getpid(), id(loop), address, actor)
    client = _clients.get(key)
    if client is None:
        client = _clients[key] = GenRMClient(address, actor)
    return client
