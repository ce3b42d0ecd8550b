"""Elastic judges: ``relay judge --config tiny-cpu-split`` scales out by one engine onto a
free virtual bundle and back in while it serves, with nothing lost (reward/scaling.py)."""

from __future__ import annotations

import json
import threading
import time
import types
import urllib.error
import urllib.request

import pytest

from reward.scaling import Scaling, ScalingRefused
from tests.helpers import interrupt
from tests.launcher.test_launch import free_port
from tests.reward.test_context_limit import post, start_relay_judge


def call(port: int, method: str, path: str, body=None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data, {"Content-Type": "application/json"},
                                     method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def settle(port: int, action: str, request_id: str, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, state = call(port, "GET", f"/genrm/{action}/{request_id}")
        assert status == 200, state
        if state["status"] in ("succeeded", "failed"):
            return state
        time.sleep(0.2)
    raise AssertionError(f"{action} {request_id} did not finish: {state}")


class Load:
    """Callers sending judge requests without pause, counting answers by status."""

    def __init__(self, port: int, callers: int = 8):
        self.port, self.statuses, self.stop = port, [], threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(callers)]

    def _run(self, k: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            body = {"messages": [{"role": "user", "content": f"caller {k} request {n}"}],
                    "sampling_params": {"temperature": 1.0, "seed": n, "max_new_tokens": 24, "ignore_eos": True}}
            self.statuses.append(post(self.port, body)[0])

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(120)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_relay_judge_scales_out_and_in_while_serving_with_nothing_lost(tmp_path):
    port = free_port()
    p = start_relay_judge(tmp_path, port)
    try:
        with Load(port) as load:
            time.sleep(1)
            status, accepted = call(port, "POST", "/genrm/scale_out", {"route_key": "__default__", "num_engines": 1})
            assert status == 202 and accepted["status"] in ("pending", "running"), accepted
            out = settle(port, "scale_out", accepted["request_id"])
            assert out["status"] == "succeeded" and out["engines"] == [2], out
            _, engines = call(port, "GET", "/genrm/engines")
            rows = engines["instances"]["__default__"]["engines"]
            assert [(r["index"], r["gpus"], r["state"]) for r in rows] == [
                (0, [0], "awake"), (1, [1], "awake"), (2, [2], "awake")], rows
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # the new engine takes its share of the load
                _, metrics = call(port, "GET", "/genrm/metrics?engines=1")
                if metrics["engines"][2].get("requests_finished", 0) > 0:
                    break
                time.sleep(0.5)
            assert metrics["num_engines"] == 3 and metrics["engines"][2]["requests_finished"] > 0, metrics
            # the node's 4 bundles: the split layout's judge has 2, the new engine 1, one is free
            status, refused = call(port, "POST", "/genrm/scale_out", {"num_engines": 2})
            assert status == 409 and "no free GPU" in refused["error"] and "1 of this node's 4" in refused["error"]
            status, refused = call(port, "POST", "/genrm/scale_in", {"num_engines": 3})
            assert status == 409 and "would leave none" in refused["error"], refused
            status, accepted = call(port, "POST", "/genrm/scale_in", {"num_engines": 2})
            assert status == 202, accepted
            out = settle(port, "scale_in", accepted["request_id"])
            assert out["status"] == "succeeded" and out["engines"] == [1, 2], out
            time.sleep(1)  # the one engine left serves the load alone
        _, engines = call(port, "GET", "/genrm/engines")
        assert [r["index"] for r in engines["instances"]["__default__"]["engines"]] == [0]
        status, health = call(port, "GET", "/genrm/health")
        assert status == 200 and health["status"] == "healthy" and "degraded" not in json.dumps(health), health
        status, report = call(port, "POST", "/genrm/reconcile")
        assert status == 200 and report["instances"]["__default__"] == {
            "before": 1, "after": 1, "dropped": [], "added": []}, report
        # nothing was lost while scaling: every request of the load got its answer
        assert len(load.statuses) > 50 and set(load.statuses) == {200}, {s: load.statuses.count(s)
                                                                           for s in set(load.statuses)}
        # scaled out again onto the freed bundles (a new index: indices are not reused)
        status, accepted = call(port, "POST", "/genrm/scale_out", {"num_engines": 1})
        out = settle(port, "scale_out", accepted["request_id"])
        assert out["status"] == "succeeded" and out["engines"] == [3], out
        assert post(port, {"messages": [{"role": "user", "content": "after"}]})[0] == 200
        for bad, why in (({"num_engines": 0}, "num_engines"), ({"num_engines": "2"}, "num_engines"),
                         ({"route_key": "nope"}, "No GenRM instance"), ({"engines": 1}, "the body must be")):
            status, refused = call(port, "POST", "/genrm/scale_out", bad)
            assert status == 400 and why in refused["error"], (bad, refused)
        assert call(port, "GET", "/genrm/scale_out/out-999")[0] == 404
    finally:
        interrupt(p)
    assert p.returncode == 0


def test_a_judge_whose_engines_no_process_can_start_refuses_scaling_saying_why():
    """A training job's judge (no engine owner attached): 409 naming relay judge."""
    instance = types.SimpleNamespace(name="__default__")
    scaling = Scaling({"__default__": instance}, lambda route_key: instance)
    with pytest.raises(ScalingRefused, match="relay judge"):
        scaling.submit("scale_out", {"num_engines": 1})
    with pytest.raises(ValueError, match="num_engines"):
        scaling.submit("scale_in", {"num_engines": True})
