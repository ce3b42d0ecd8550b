"""Engines behind relay: the rest of the system reaches them only through EngineActor."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from engines.actor import EngineActor
from engines.models.model_builder import make_model
from relay import ActorError, this_host
from tests.helpers import run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def test_engine_actor_generate_sleep_wake_and_sync(tmp_path):
    policy = make_model("qwen3", "tiny", str(tmp_path / "p"), seed=1)
    other = make_model("qwen3", "tiny", str(tmp_path / "o"), seed=2)

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        engines = procs.spawn("rollout", EngineActor, policy, "torch", kv_cache_tokens=1024, weights_mode="discard")
        await engines.initialized(timeout=120)
        prompt = [5, 6, 7, 8, 9]
        first = (await engines.generate.call(prompt, GREEDY)).values()
        assert first[0].token_ids == first[1].token_ids and len(first[0].token_ids) == 8
        await engines.sleep.call(["weights", "kv_cache"])
        stats = (await engines.stats.call()).values()
        assert all(s["bytes"]["weights"] == 0 and s["bytes"]["kv_cache"] == 0 for s in stats)
        await engines.wake.call(["weights"])
        tensors = load_file(f"{other}/model.safetensors")  # CPU tensors travel as zero-copy frames
        await engines.update_weights.call([tensors], 3)
        await engines.wake.call(["kv_cache"])
        after = (await engines.generate.call(prompt, GREEDY)).values()
        assert all(r.weight_version == 3 for r in after)
        assert after[0].logprobs != first[0].logprobs
        events = (await engines.events.call()).values()[0]
        assert [e[1] for e in events] == ["sleep", "wake", "update_weights", "wake"]
        with pytest.raises(ActorError, match="top_p"):
            await engines.slice(gpus=0).generate.call_one(prompt, {"top_p": 2})
        await procs.stop()

    run(main(), 240)


def test_unknown_backend_fails_at_setup(tmp_path, faults):
    policy = make_model("qwen3", "tiny", str(tmp_path / "p"), seed=1)

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        bad = procs.spawn("bad", EngineActor, policy, "vllm")
        with pytest.raises(ActorError, match="unknown engine backend 'vllm'"):
            await bad.initialized(timeout=120)
        await procs.stop()

    run(main(), 240)
    assert faults and faults[0].actor == "bad"


def test_generate_rendered_tokenizes_chats_like_apply_chat_template(tmp_path):
    """The judge service sends rendered chat text; the engine's tokenizing gives the output
    and prompt length that the same chat as messages gives, for every request of a batch,
    and a malformed request fails alone."""
    from transformers import AutoTokenizer

    judge = make_model("qwen3", "tiny", str(tmp_path / "j"), seed=3)
    tok = AutoTokenizer.from_pretrained(judge)
    chats = [[{"role": "user", "content": f"Is {i}+{i}={2 * i}? Reply 1 or 0."}] for i in range(5)]
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        engine = procs.spawn("judge", EngineActor, judge, "torch", kv_cache_tokens=2048)
        await engine.initialized(timeout=120)
        got = await engine.generate_rendered.call_one([[t, GREEDY] for t in texts] + [[7, GREEDY]]).result(120)
        want = await engine.generate_batch.call_one([[c, GREEDY] for c in chats]).result(120)
        for g, w, c in zip(got, want, chats):
            assert g.token_ids == w.token_ids and g.prompt_tokens == w.prompt_tokens
            assert g.prompt_tokens == len(
                tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
            )
        assert isinstance(got[-1], TypeError) and "rendered chat text" in str(got[-1])
        await procs.stop()

    run(main(), 240)
