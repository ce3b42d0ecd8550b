"""The judge client over the HTTP gateway, for reward code written for the original:
``get_genrm_client(service_url="http://127.0.0.1:8000/genrm")`` (or an ``http(s)://`` address)
gives this client, with the ZeroMQ client's calls and errors:

- ``await client.generate(messages, sampling_params=None, route_key=None, timeout=None) -> str``
  (``POST {service_url}/generate``); ``generate_many``;
- ``client.health_check()`` / ``client.get_metrics()``, synchronous as the original's (one
  blocking HTTP request: they tell the truth from any thread, the event loop's included),
  and their ``*_async`` forms; neither raises.

Errors as the ZeroMQ client types them: a 4xx is the request's own (``ValueError``, never
retried); 503 while the judge sleeps is :class:`~reward.errors.JudgeAsleep`; 502 is
:class:`~reward.errors.JudgeEngineError`; other 5xx and transport failures are retried
(``retries`` times, with backoff), then :class:`~reward.errors.JudgeUnavailable`. A bearer
token (``token``, else ``RELAY_GENRM_TOKEN``) goes in ``Authorization``.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

from reward.settings import settings as reward_settings

from .errors import JudgeAsleep, JudgeEngineError, JudgeUnavailable

STATUS_TIMEOUT = 10.0  # seconds: health_check / get_metrics


class HTTPGenRMClient:
    def __init__(self, service_url: str, timeout: float = 1800.0, retries: int = 2, token: str | None = None):
        if not service_url.startswith(("http://", "https://")):
            raise ValueError(f"service_url must be an http:// or https:// URL, not {service_url!r}")
        self.url = service_url.rstrip("/")
        self.timeout = timeout
        self.retries = retries
        self.token = token if token is not None else reward_settings().genrm_token
        self._session = None  # aiohttp's, made on the loop of the first call
        self._session_loop = None

    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    async def generate(self, messages: list, sampling_params: dict | None = None, route_key: str | None = None,
                       timeout: float | None = None) -> str:
        import aiohttp

        body: dict = {"messages": messages}
        if sampling_params is not None:
            body["sampling_params"] = sampling_params
        if route_key is not None:
            body["route_key"] = route_key
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                session = self._session_here()
                async with session.post(f"{self.url}/generate", json=body, headers=self._headers(),
                                        timeout=aiohttp.ClientTimeout(total=timeout or self.timeout)) as r:
                    text = await r.text()
                    if r.status == 200:
                        return json.loads(text)["response"]
                    error = _error_of(text)
                    if r.status == 503 and "asleep" in error.lower():
                        raise JudgeAsleep(error)
                    if r.status == 502:
                        raise JudgeEngineError(error)
                    if 400 <= r.status < 500:
                        raise ValueError(f"judge at {self.url}: HTTP {r.status}: {error}")
                    last = JudgeUnavailable(f"HTTP {r.status}: {error}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = e
            await asyncio.sleep(0.5 * (attempt + 1))
        raise JudgeUnavailable(f"judge at {self.url} failed {self.retries + 1} times: {last}")

    async def generate_many(self, list_of_messages: list, sampling_params: dict | None = None,
                            route_key: str | None = None) -> list[str]:
        return await gather_all([self.generate(m, sampling_params, route_key) for m in list_of_messages])

    def _session_here(self):
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session, self._session_loop = aiohttp.ClientSession(), loop
        return self._session

    def _get(self, route: str) -> dict:
        """``GET {service_url}/{route}``'s JSON body, whatever the status (a 503 health body
        says why); raises on transport failures."""
        request = urllib.request.Request(f"{self.url}/{route}", headers=self._headers())
        try:
            with urllib.request.urlopen(request, timeout=STATUS_TIMEOUT) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read() or b"{}")

    def health_check(self) -> dict:
        """``GET /genrm/health``'s body, or ``{"status": "unhealthy", "error": ...}``; never raises."""
        try:
            return self._get("health")
        except Exception as e:  # noqa: BLE001 - reported, never raised
            return {"status": "unhealthy", "service": "genrm", "error": f"{type(e).__name__}: {e}"}

    def get_metrics(self) -> dict:
        """``GET /genrm/metrics``'s body, or ``{}``; never raises."""
        try:
            return self._get("metrics")
        except Exception:  # noqa: BLE001
            return {}

    async def health_check_async(self) -> dict:
        return await asyncio.to_thread(self.health_check)

    async def get_metrics_async(self) -> dict:
        return await asyncio.to_thread(self.get_metrics)

    def report_parse(self, route_key: str | None, ok: bool) -> None:
        """The gateway has no route for verdict parse reports: nothing to do."""

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _error_of(text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500]
    return str(body.get("error") or body.get("detail") or body) if isinstance(body, dict) else str(body)[:500]


async def gather_all(calls: list) -> list:
    """Every call's result, each call run to its end whatever the others do; then the first
    error, if any, is raised: a bad conversation in a ``generate_many`` does not stop the
    others from being judged (and cached)."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return list(results)
