"""The original documentation's reward code, run here with only the judge client's import
line changed (tests/reward/original_snippets.py holds its text verbatim), and the examples
of examples/generate_reward_model/ by their documented module paths, against a live judge
service with one instance per route key (tiny built-in engines)."""

from __future__ import annotations

import ast
import asyncio
import os
import statistics
from types import SimpleNamespace

import pytest

from engines.actor import EngineActor
from launcher.config import load_config
from launcher.data import Row
from launcher.rl.sample import Sample
from relay import this_host
from reward.judge import start_judge_service
from reward.rewards import load_callable, make_reward_fn
from tests.helpers import run
from tests.reward import original_snippets as orig

REFERENCE = "/work/shared/reference/000_c5ba0d09850e783e.txt"
ROUTES = ("__default__", "quality", "safety", "planner_judge", "tool_call_judge", "final_answer_judge")
SWAP_HOOK = "examples.generate_reward_model.post_process_genrm_swap.custom_reward_post_process"
DUAL = "examples.generate_reward_model.reward_dual_genrm_quality_safety.reward_func"
AGENTIC = "examples.generate_reward_model.agentic_routing.agentic_reward_func"


def sample(response: str, label: str = "4", question: str = "2+2?", index: int = 0, **metadata) -> Sample:
    result = SimpleNamespace(token_ids=[5, 6], text=response, logprobs=[-0.1, -0.2], finish_reason="stop",
                             weight_version=0)
    row = Row(index, [{"role": "user", "content": question}], label, metadata=metadata)
    return Sample.generated(row, "train", index, [1, 2], result)


async def start(judge_model):
    """A judge service with one instance per route of :data:`ROUTES`, all served by one
    tiny engine (one process: the machine running the tests may be small)."""
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="judges")
    engines = procs.spawn("judge-engine", EngineActor, judge_model, "torch", kv_cache_tokens=4096)
    await engines.initialized(120)
    spec = {name: {"model_path": judge_model, "num_gpus": 1, "engines": [engines.slice(gpus=0)],
                   "sampling_config": {"temperature": 0.0, "max_response_len": 4}} for name in ROUTES}
    judge, judge_procs = await start_judge_service(spec, 120)
    return procs, judge, judge_procs


async def run_snippet(text: str, namespace: dict | None = None) -> dict:
    """Execute ``text`` as a module body that may ``await`` at top level; its namespace."""
    ns = {"__name__": "snippet"} if namespace is None else namespace
    code = compile(text, "<the original's documentation>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    out = eval(code, ns)  # noqa: S307 (the documentation's own code)
    if asyncio.iscoroutine(out):
        await out
    return ns


@pytest.mark.unit
@pytest.mark.skipif(not os.path.exists(REFERENCE), reason="the original's documentation is not on this machine")
def test_the_snippets_are_the_documentations_text_verbatim():
    with open(REFERENCE) as f:
        text = f.read()
    for name in ("ROUTE_KEY_SNIPPET", "AGENTIC_SNIPPET", "DAPO_GENRM_SNIPPET", "CLIENT_SNIPPET"):
        assert getattr(orig, name).rstrip("\n") in text, name
    # our agentic example is the documented function, verbatim from its route table on
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "examples", "generate_reward_model", "agentic_routing.py")) as f:
        assert orig.AGENTIC_SNIPPET.rstrip("\n") in f.read()


@pytest.mark.unit
def test_the_documented_dapo_genrm_and_ours_send_the_same_prompt_and_return_the_same_result(monkeypatch):
    """The documentation's async_compute_score_genrm (run as written, with a fake client) and
    our --rm-type dapo-genrm given the documented template (the "..." included): the same
    messages to the judge, the same {score, acc, pred} for every reply."""
    import reward.client

    sent: list = []
    replies = iter([])

    class Client:
        async def generate(self, messages, sampling_params=None, route_key=None):
            sent.append(messages)
            return next(replies)

        def report_parse(self, route_key, ok):
            pass

    monkeypatch.setattr(reward.client, "get_genrm_client", lambda address=None: Client())
    ns = asyncio.run(run_snippet(orig.ported(orig.DAPO_GENRM_SNIPPET)))
    documented = ns["async_compute_score_genrm"]
    ours = make_reward_fn(load_config(None, {"rm_type": "dapo-genrm",
                                             "genrm_prompt_template": ns["DAPO_GENRM_PROMPT_TEMPLATE"]}))
    responses = ["work\nAnswer: 4", "Answer: 3\nAnswer:  4 \n", "no marker " * 50, "4", "x" * 299 + "Answer:"]
    for response in responses:
        for reply in ("1", " 1\n", "0", "1.", "Yes", "Judgement: 1", ""):
            s = sample(response)
            replies = iter([reply, reply])
            want = asyncio.run(documented(None, s))
            got = asyncio.run(ours(s))
            assert sent[-2] == sent[-1], (response, reply)
            assert {k: got[k] for k in ("score", "acc", "pred")} == want, (response, reply)
            assert type(got["acc"]) is type(want["acc"]) and type(got["score"]) is type(want["score"])


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_documentations_reward_code_runs_against_a_live_judge(judge_model, monkeypatch):
    counts: dict = {}

    async def main():
        procs, judge, judge_procs = await start(judge_model)
        monkeypatch.setenv("RELAY_GENRM_ADDR", judge._view.members[0].proc.addr)

        async def requests() -> dict:
            snap = await judge.metrics_snapshot.call_one()
            return {k: snap[k].get("requests", 0) for k in ROUTES}  # absent before its first request

        async def delta(step, *args):
            before = await requests()
            out = await step(*args)
            after = await requests()
            counts[step.__name__] = {k: after[k] - before[k] for k in ROUTES if after[k] != before[k]}
            return out

        async def client_snippet():
            return await run_snippet(orig.ported(orig.CLIENT_SNIPPET))

        async def route_key_snippet():
            return await run_snippet(orig.ported(orig.ROUTE_KEY_SNIPPET))

        async def dapo_genrm_snippet(samples):
            ns = await run_snippet(orig.ported(orig.DAPO_GENRM_SNIPPET))
            return [await ns["async_compute_score_genrm"](None, s) for s in samples]

        async def agentic_snippet(s):
            ns = {"__name__": "snippet"}
            exec("from examples.generate_reward_model.agentic_routing import _format_step_messages, "
                 "_parse_judgement", ns)  # the helpers the documentation leaves to the user
            ns = await run_snippet(orig.ported(orig.AGENTIC_SNIPPET), ns)
            return await ns["agentic_reward_func"](None, s)

        async def dual(samples):
            fn = load_callable(DUAL, "--custom-rm-path")
            return [await fn(None, s) for s in samples]

        async def swap_hook(args, samples):
            return await load_callable(SWAP_HOOK, "--custom-reward-post-process-path")(args, samples)

        try:
            out = {"client": await delta(client_snippet), "route": await delta(route_key_snippet)}
            math = [sample("so Answer: 4"), sample("Answer: 5"), sample("I think it is 4")]
            out["dapo"] = await delta(dapo_genrm_snippet, math)
            steps = [{"module": m, "input": f"in {i}", "output": f"out {i}"}
                     for i, m in enumerate(["plan", "tool_call", "tool_call", "final_answer"])]
            agent = sample("done", trajectory_steps=steps)
            out["agentic"] = await delta(agentic_snippet, agent)
            out["agentic_module"] = await load_callable(AGENTIC, "--custom-rm-path")(None, agent)
            out["dual"] = await delta(dual, [sample("so \\boxed{4}"), sample("no final answer here")])
            args = load_config(None, {"n_samples_per_prompt": 2, "rm_type": "dummy",
                                      "custom_reward_post_process_path": SWAP_HOOK})
            batch = [sample(r, index=i // 2) for i, r in enumerate(["Answer: 4", "Answer: 3", "4", "Answer: 4"])]
            out["swap"] = await delta(swap_hook, args, batch)
            out["batch"] = batch
            builtin = make_reward_fn(load_config(None, {"rm_type": "dapo-genrm"}))
            out["builtin"] = [await builtin(sample(s.response, index=s.index)) for s in batch]
            return out
        finally:
            await judge_procs.stop()
            await procs.stop()

    out = run(main(), 280)
    # the client snippet: one call, no route_key -> the "__default__" instance
    assert isinstance(out["client"]["response"], str) and counts["client_snippet"] == {"__default__": 1}
    # the route_key snippet: one call to each named instance
    assert isinstance(out["route"]["quality_response"], str) and isinstance(out["route"]["safety_response"], str)
    assert counts["route_key_snippet"] == {"quality": 1, "safety": 1}
    # the documented dapo-genrm: its return shape, from three judge calls
    assert counts["dapo_genrm_snippet"] == {"__default__": 3}
    for r in out["dapo"]:
        assert set(r) == {"score", "acc", "pred"} and r["score"] == (1.0 if r["pred"] == "1" else 0.0)
        assert r["acc"] == int(r["score"])
    # the agentic snippet: each step to its module's judge; the score is the mean of the steps'
    assert counts["agentic_snippet"] == {"planner_judge": 1, "tool_call_judge": 2, "final_answer_judge": 1}
    assert set(out["agentic"]) == {"score"} and 0.0 <= out["agentic"]["score"] <= 1.0
    assert out["agentic"]["score"] in {k / 4 for k in range(5)} and out["agentic_module"] == out["agentic"]
    # quality x safety: the quality judge only for a response with a final answer
    assert counts["dual"] == {"quality": 1, "safety": 2}
    answered, unanswered = out["dual"]
    assert answered["score"] == answered["quality"] * answered["safety"] and answered["format_ok"]
    assert unanswered["score"] == 0.0 and unanswered["quality"] == 0 and not unanswered["format_ok"]
    # the defer-swap hook: the built-in dapo-genrm's scores, group-normalized by the hook itself
    raw, normalized = out["swap"]
    assert counts["swap_hook"] == {"__default__": 4}
    assert raw == [r["score"] for r in out["builtin"]] == [s.reward for s in out["batch"]]
    assert [s.reward_info for s in out["batch"]] == out["builtin"]
    for g in (0, 2):
        group = raw[g : g + 2]
        std = statistics.pstdev(group)
        assert normalized[g : g + 2] == pytest.approx([(x - statistics.fmean(group)) / (std + 1e-6) for x in group])
