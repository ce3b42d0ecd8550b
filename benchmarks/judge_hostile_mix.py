"""Innocent load beside attackers against a live judge: innocent failures, throughput and p99,
with and without the hostile mix, and the judge's memory. Prints one JSON line.

    python benchmarks/judge_hostile_mix.py [--before TREE] [--seconds 20] [--attackers 8]

Each tree (this checkout, and ``--before``: another checkout, e.g. ``git worktree add
/tmp/before <commit>``) runs ``relay judge --config tiny-cpu-split`` (two real CPU engines)
from its own code; the trees take turns in one run (noisy machine: compare within a run).
Per tree, three phases: ``clean`` (innocent callers only), ``attack`` (the same callers
beside ``--attackers`` clients sending the hostile mix, plus connections that fill the
gateway's cap and keep themselves alive with a cheap request every few seconds), and the
memory of the judge's processes (the gateway's and the engines') before, right after and
``--settle`` seconds after the attack. Innocent callers use one keep-alive connection
each, as a client library would; a failure is anything but a 200 (an error status or a
dropped connection). The hostile mix is issue 46's list: lone surrogates (chat, native,
OpenAI), a float32-zero repetition penalty, near-1 MiB prompts, integers past float64,
``n`` 128, a chunked upload. Attackers send ``--attack-rate`` requests a second each (a
flood as fast as answered, ``--attack-rate 0``, measures how two shared cores split, not
what one request does to another).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import aiohttp

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MSG = [{"role": "user", "content": "Is 2+2=4? Answer 1 or 0."}]
HOSTILE = [
    ("/genrm/generate", {"messages": [{"role": "user", "content": "a lone surrogate \ud800"}]}),
    ("/genrm/generate", {"messages": [{"role": "u\udc00", "content": "x"}]}),
    ("/genrm/generate", {"text": "native \ud83d"}),
    ("/genrm/generate", {"messages": MSG, "sampling_params": {"stop": ["\ud800"]}}),
    ("/genrm/generate", {"messages": MSG, "sampling_params": {"repetition_penalty": 1e-40, "temperature": 0.7}}),
    ("/genrm/generate", {"messages": [{"role": "user", "content": "y" * 1_040_000}]}),
    ("/genrm/generate", {"messages": MSG, "sampling_params": {"temperature": 10**309}}),
    ("/genrm/generate", {"messages": MSG, "sampling_params": {"n": 128}}),
    ("/genrm/v1/chat/completions", {"model": "__default__", "messages": [{"role": "user", "content": "\udfff"}]}),
]
CHUNKED = (b"POST /genrm/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
           b"Content-Type: application/json\r\n\r\n10\r\n{\"messages\": []}\r\n0\r\n\r\n")
_unique = itertools.count()


def start_judge(tree: str, port: int, cache: str, max_connections: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=tree, RELAY_CACHE=cache, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-c", "import sys; from launcher.cli import main; sys.exit(main())", "judge",
           "--config", "tiny-cpu-split", "--port", str(port),
           "--genrm-gateway-max-connections", str(max_connections)]
    p = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    seen, ready = [], threading.Event()

    def pump():
        for line in p.stdout:
            seen.append(line)
            if "judge ready" in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + 600
    while not ready.wait(0.5):
        if p.poll() is not None or time.monotonic() > deadline:
            stop(p)
            raise RuntimeError(f"relay judge ({tree}) did not start:\n{''.join(seen)[-3000:]}")
    return p


def stop(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGINT)
        p.wait(60)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def tree_rss_mb(root: int) -> dict:
    """Resident memory (MB) of ``root`` and its descendants, by command line (the engines' and
    the judge service's processes)."""
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
        except (OSError, StopIteration):
            pass
    return round(total, 1)


async def innocent(url: str, until: float, concurrency: int) -> dict:
    latencies, failures, errors = [], 0, {}

    async def caller(k: int):
        nonlocal failures
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
            while time.monotonic() < until:
                body = {"messages": [{"role": "user", "content": f"Is {k}+{next(_unique)}>0? Answer 1 or 0."}]}
                t = time.monotonic()
                try:
                    async with s.post(f"{url}/genrm/generate", json=body,
                                      timeout=aiohttp.ClientTimeout(total=60)) as r:
                        await r.read()
                        ok = r.status == 200
                        why = str(r.status)
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    ok, why = False, type(e).__name__
                if ok:
                    latencies.append(time.monotonic() - t)
                else:
                    failures += 1
                    errors[why] = errors.get(why, 0) + 1

    t0 = time.monotonic()
    await asyncio.gather(*(caller(k) for k in range(concurrency)))
    latencies.sort()
    return {"ok": len(latencies), "failures": failures, "errors": errors,
            "per_s": round(len(latencies) / (time.monotonic() - t0), 1),
            "p50_ms": round(1000 * latencies[len(latencies) // 2], 1) if latencies else None,
            "p99_ms": round(1000 * latencies[int(len(latencies) * 0.99)], 1) if latencies else None}


BODIES = [(path, json.dumps(body).encode()) for path, body in HOSTILE]  # encoded once: the load generator
# shares the machine's cores with the judge, so its own work is kept small


async def attacker(url: str, port: int, until: float, k: int, rate: float, tally: dict) -> None:
    """Cycles through the hostile mix at ``rate`` requests a second (0: as fast as answered)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        for i in itertools.count(k):
            if time.monotonic() >= until:
                return
            if rate:
                await asyncio.sleep(1 / rate)
            if i % (len(HOSTILE) + 1) == len(HOSTILE):
                status = await asyncio.to_thread(_raw, port, CHUNKED)
            else:
                path, body = BODIES[i % (len(HOSTILE) + 1)]
                try:
                    async with s.post(url + path, data=body,
                                      headers={"Content-Type": "application/json"},
                                      timeout=aiohttp.ClientTimeout(total=60)) as r:
                        await r.read()
                        status = r.status
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    status = type(e).__name__
            tally[str(status)] = tally.get(str(status), 0) + 1


def _raw(port: int, data: bytes) -> str:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(data)
            return c.recv(64).split(b" ")[1].decode() or "closed"
    except (OSError, IndexError):
        return "reset"


async def holders(port: int, until: float, n: int, every: float, tally: dict) -> None:
    """``n`` connections, each sending a cheap health request every ``every`` seconds (and
    reopened when the gateway closes it), for as long as the attack lasts."""
    async def hold(k: int):
        await asyncio.sleep(k * every / n)
        while time.monotonic() < until:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                tally["connect_failed"] = tally.get("connect_failed", 0) + 1
                await asyncio.sleep(every)
                continue
            try:
                while time.monotonic() < until:
                    writer.write(b"GET /genrm/health HTTP/1.1\r\nHost: x\r\n\r\n")
                    await writer.drain()
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                    length = int(next((ln.split(b":")[1] for ln in head.split(b"\r\n")
                                       if ln.lower().startswith(b"content-length")), b"0"))
                    await reader.readexactly(length)
                    tally["trickles"] = tally.get("trickles", 0) + 1
                    await asyncio.sleep(every)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError):
                tally["holder_closed"] = tally.get("holder_closed", 0) + 1
            finally:
                writer.close()

    await asyncio.gather(*(hold(k) for k in range(n)))


async def measure(tree: str, args, cache: str) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    p = await asyncio.to_thread(start_judge, tree, port, cache, args.max_connections)
    url = f"http://127.0.0.1:{port}"
    try:
        await innocent(url, time.monotonic() + 3, args.concurrency)  # warm-up
        rss = {"before": tree_rss_mb(p.pid)}
        clean = await innocent(url, time.monotonic() + args.seconds, args.concurrency)
        tally: dict = {}
        until = time.monotonic() + args.seconds
        hold = asyncio.ensure_future(holders(port, until, args.max_connections, args.trickle, tally))
        attack = asyncio.ensure_future(asyncio.gather(*(attacker(url, port, until, k, args.attack_rate, tally)
                                                        for k in range(args.attackers))))
        await asyncio.sleep(1)  # the holders fill the cap first
        under = await innocent(url, until, args.concurrency)
        await attack
        await hold
        rss["attack_end"] = tree_rss_mb(p.pid)
        await asyncio.sleep(args.settle)
        rss["settled"] = tree_rss_mb(p.pid)
        return {"clean": clean, "attack": under, "attackers_got": tally, "rss_mb": rss,
                "innocent_throughput_vs_clean": round(under["per_s"] / max(clean["per_s"], 1e-9), 3)}
    finally:
        await asyncio.to_thread(stop, p)


async def main(args) -> dict:
    trees = {"after": os.path.abspath(args.after)}
    if args.before:
        trees["before"] = os.path.abspath(args.before)
    cache = args.cache or tempfile.mkdtemp(prefix="hostile-mix-")
    out = {"seconds": args.seconds, "attackers": args.attackers, "attack_rate": args.attack_rate,
           "concurrency": args.concurrency, "max_connections": args.max_connections, "rounds": args.rounds}
    runs: dict[str, list] = {name: [] for name in trees}
    for r in range(args.rounds):  # the trees take turns, in alternating order
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            runs[name].append(await measure(trees[name], args, cache))
    for name, results in runs.items():
        out[name] = {
            "innocent_failures_clean": sum(m["clean"]["failures"] for m in results),
            "innocent_failures_attack": sum(m["attack"]["failures"] for m in results),
            "per_s_clean": statistics.median(m["clean"]["per_s"] for m in results),
            "per_s_attack": statistics.median(m["attack"]["per_s"] for m in results),
            "p99_ms_clean": statistics.median(m["clean"]["p99_ms"] or 0 for m in results),
            "p99_ms_attack": statistics.median(m["attack"]["p99_ms"] or 0 for m in results),
            "throughput_attack_vs_clean": statistics.median(m["innocent_throughput_vs_clean"] for m in results),
            "rounds": results,
        }
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--after", default=HERE, help="the checkout measured as 'after' (default: this one)")
    ap.add_argument("--before", help="another checkout to measure in the same run (the code before a change)")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of the clean and the attack phase")
    ap.add_argument("--attackers", type=int, default=8)
    ap.add_argument("--attack-rate", type=float, default=10.0,
                    help="hostile requests a second per attacker (0: each as soon as the last is answered)")
    ap.add_argument("--concurrency", type=int, default=16, help="innocent callers")
    ap.add_argument("--max-connections", type=int, default=128, help="the gateway's cap, filled by the holders")
    ap.add_argument("--trickle", type=float, default=5.0, help="seconds between a holder's health requests")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds after the attack before memory is read")
    ap.add_argument("--rounds", type=int, default=1, help="measurements per tree (trees alternate)")
    ap.add_argument("--cache", help="RELAY_CACHE for the tiny models (default: a new temporary directory)")
    print(json.dumps(asyncio.run(main(ap.parse_args()))))
