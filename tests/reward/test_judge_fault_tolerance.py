"""`relay judge` survives the death of an engine process: the service keeps answering on
the other engine (retrying what the dead one held), reports degraded health, and a new
engine takes the dead one's place."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import aiohttp
import pytest

from tests.helpers import interrupt, live_pids_by_env
from tests.launcher.test_launch import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")


def _engine_pids(parent: int) -> list[int]:
    """Live judge engine processes `relay judge` (pid ``parent``) started."""
    return sorted(pid for pid, env in live_pids_by_env().items()
                  if env.get(b"RELAY_PARENT_PID") == str(parent).encode()
                  and env.get(b"RELAY_PROC_ID", b"").startswith(b"judge-"))


class Output:
    """Every line a process prints, as it comes."""

    def __init__(self, stream):
        self.lines: list[str] = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream):
        for line in stream:
            self.lines.append(line)

    def wait_for(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(needle in line for line in self.lines):
            assert time.monotonic() < deadline, f"{needle!r} not printed: {''.join(self.lines)[-3000:]}"
            time.sleep(0.05)


def test_relay_judge_keeps_answering_while_an_engine_dies_and_is_replaced(tmp_path):
    """Steady load on `relay judge --config tiny-cpu-split` (2 engines); one engine process is
    killed (SIGKILL): at most 1% of the requests in the kill window fail and none after it,
    health says degraded (200, 1 of 2 engines) until a new engine serves, then healthy with
    2 engines again; Ctrl-C then stops every process."""
    port = free_port()
    env = dict(os.environ, RELAY_CACHE=str(tmp_path / "cache"), RELAY_JOB_SECRET=secrets.token_hex(32))
    p = subprocess.Popen([RELAY, "judge", "--config", "tiny-cpu-split", "--port", str(port)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/genrm"
    out = Output(p.stdout)
    try:
        out.wait_for("judge ready", 180)
        engines = _engine_pids(p.pid)
        assert len(engines) == 2, engines

        async def main():
            outcomes: list[tuple[float, int]] = []  # (time answered, HTTP status)
            healths: list[tuple[int, dict]] = []
            stop = asyncio.Event()
            async with aiohttp.ClientSession() as s:

                async def caller(k: int):
                    n = 0
                    while not stop.is_set():
                        n += 1
                        body = {"messages": [{"role": "user", "content": f"caller {k} request {n}: is 2+2=4?"}]}
                        async with s.post(f"{url}/generate", json=body) as r:
                            await r.read()
                            outcomes.append((time.monotonic(), r.status))

                async def health() -> tuple[int, dict]:
                    async with s.get(f"{url}/health") as r:
                        return r.status, await r.json()

                callers = [asyncio.ensure_future(caller(k)) for k in range(6)]
                await asyncio.sleep(2.0)
                killed_at = time.monotonic()
                os.kill(engines[0], signal.SIGKILL)
                back_at = None
                while time.monotonic() - killed_at < 120:
                    status, body = await health()
                    healths.append((status, body))
                    if body.get("status") == "healthy" and len(healths) > 1:
                        back_at = time.monotonic()
                        break
                    await asyncio.sleep(0.1)
                await asyncio.sleep(3.0)
                stop.set()
                await asyncio.gather(*callers)
                return outcomes, healths, killed_at, back_at

        outcomes, healths, killed_at, back_at = asyncio.run(main())
        assert back_at is not None, healths[-3:]
        before = [s for t, s in outcomes if t < killed_at]
        window = [s for t, s in outcomes if killed_at <= t <= back_at]
        after = [s for t, s in outcomes if t > back_at]
        print(json.dumps({"requests_before": len(before), "window_s": round(back_at - killed_at, 2),
                          "requests_in_window": len(window), "failed_in_window": sum(s != 200 for s in window),
                          "requests_after": len(after)}))
        assert before and all(s == 200 for s in before)
        assert len(window) >= 20 and sum(s != 200 for s in window) <= 0.01 * len(window), window
        assert len(after) >= 10 and all(s == 200 for s in after)
        degraded = [b for st, b in healths if b.get("degraded")]
        assert degraded and all(st == 200 for st, b in healths), healths
        assert degraded[0]["engines_working"] == 1 and degraded[0]["engines"] == 2
        assert healths[-1] == (200, {"status": "healthy", "service": "genrm"})
        out.wait_for("is back", 10)
        text = "".join(out.lines)
        assert "relay judge: engine 0 of '__default__' died" in text, text[-2000:]
        replaced = _engine_pids(p.pid)
        assert len(replaced) == 2 and engines[0] not in replaced and engines[1] in replaced
    finally:
        interrupt(p)
    assert p.returncode == 0, "".join(out.lines)[-3000:]
    assert "judge stopped" in "".join(out.lines)
    time.sleep(0.5)
    assert not [pid for pid in engines + replaced if os.path.exists(f"/proc/{pid}")
                and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
