"""``--custom-generate-function-path`` (slime's custom rollout contract), part by part: the
sample a function fills in (``tokens``, ``response_length``, ``loss_mask``,
``rollout_log_probs``, ``status``) and its checks; SGLang's ``/generate`` served over a real
built-in engine (what ``args.sglang_router_ip:port`` answers); the trainer's batch of
masked, log-prob-less samples; the function's own mistakes."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from launcher.config import load_config
from launcher.data import Row
from launcher.rl.custom_rollout import CustomRollout, RolloutHTTP
from launcher.rl.sample import Sample, Status
from launcher.rl.scoring import training_batch

pytestmark = pytest.mark.unit


def given(prompt_ids=(1, 2, 3)) -> Sample:
    return Sample(index=0, dataset="train", group_index=0, prompt="Q", label="4", metadata={"question": "Q"},
                  prompt_ids=list(prompt_ids), response_ids=[], response="", rollout_logprobs=None,
                  finish_reason="stop", weight_version=0, status=Status.PENDING)


def test_a_slime_style_function_extends_tokens_and_response_length_turn_by_turn():
    s = given()
    for new in ([7, 8], [9]):  # slime's own generate: tokens += new, response_length += len(new)
        s.tokens = s.tokens + new
        s.response_length += len(new)
    s.loss_mask, s.rollout_log_probs = [1, 1, 0], [-0.5, -0.25, 0.0]
    s.settle("f")
    assert (s.prompt_ids, s.response_ids, s.tokens) == ([1, 2, 3], [7, 8, 9], [1, 2, 3, 7, 8, 9])
    assert s.response_length == 3 and s.status is Status.COMPLETED  # left PENDING: generated to its end
    # a function that tokenized the prompt itself: response_length decides the split
    t = given()
    t.tokens, t.response_length = [5, 5, 5, 5, 7], 1
    t.status = Sample.Status.TRUNCATED
    assert t.settle("f").prompt_ids == [5, 5, 5, 5] and t.response_ids == [7]


@pytest.mark.parametrize("change,message", [
    (lambda s: setattr(s, "loss_mask", [1]), "sample.loss_mask has 1 entries for 2 response tokens"),
    (lambda s: setattr(s, "loss_mask", [1, 2]), "sample.loss_mask must hold 0 or 1"),
    (lambda s: setattr(s, "rollout_log_probs", [-1.0]), "sample.rollout_log_probs has 1 entries for 2"),
    (lambda s: setattr(s, "response_length", 9), r"sample.response_length must be an integer in \[0, 5\)"),
    (lambda s: setattr(s, "tokens", [1, "2", 3]), "sample.tokens must be a list of token ids"),
    (lambda s: setattr(s, "status", Status.FAILED), "sample.status must be Sample.Status.COMPLETED"),
])
def test_a_sample_filled_in_wrong_is_refused_naming_the_field(change, message):
    s = given()
    s.tokens, s.response_length = [1, 2, 3, 7, 8], 2
    change(s)
    with pytest.raises(ValueError, match=f"--custom-generate-function-path my.gen: {message}"):
        s.settle("--custom-generate-function-path my.gen")


def test_the_trainer_batch_masks_what_the_policy_did_not_write_and_goes_without_log_probs():
    cfg = load_config(None, {"n_samples_per_prompt": 2, "rollout_batch_size": 1})
    a, b = given(), given()
    a.tokens, a.response_length, a.loss_mask, a.rollout_log_probs = [1, 2, 3, 7, 8, 9], 3, [1, 0, 1], [-1, 0, -2]
    b.tokens, b.response_length, b.rollout_log_probs = [1, 2, 3, 6], 1, None
    for s, r in ((a, 1.0), (b, 0.0)):
        s.settle("f")
        s.reward = r
    batch = training_batch([a, b], cfg, 2)
    assert batch.response_masks == [[0, 0, 1, 0, 1], [0, 0, 1]] and batch.rollout_logprobs is None
    tis = load_config(None, {"n_samples_per_prompt": 2, "rollout_batch_size": 1, "use_tis": True})
    with pytest.raises(ValueError, match="--use-tis needs the rollout's log-probs.*sample.rollout_log_probs"):
        training_batch([a, b], tis, 2)
    b.rollout_log_probs = [-0.5]
    assert training_batch([a, b], tis, 2).rollout_logprobs == [[0.0, 0.0, -1, 0, -2], [0.0, 0.0, -0.5]]


class EnginePool:
    """The part of RolloutPool that RolloutHTTP uses, over one real in-process engine."""

    def __init__(self, engine):
        self.engine, self.engines = engine, [engine]

    async def on_one_engine(self, requests):
        return [await self.engine.generate(p, s) for p, s in requests]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from engines.models.model_builder import make_model

    path = str(tmp_path_factory.mktemp("policy") / "m")
    make_model("qwen3", "tiny", path, seed=1)
    return path


def test_the_rollout_engines_answer_sglangs_generate(policy):
    from engines.builtin.engine import TorchEngine

    async def main():
        http = RolloutHTTP(EnginePool(TorchEngine(policy, kv_cache_tokens=512)), policy)
        port = await http.server.start("127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                async def post(body, **kw):
                    async with session.post(url + "/generate", json=body, **kw) as r:
                        return r.status, await r.json()

                sp = {"temperature": 0.7, "max_new_tokens": 5, "sampling_seed": 11,
                      "spaces_between_special_tokens": False}
                status, out = await post({"input_ids": [3, 4, 5], "sampling_params": sp, "return_logprob": True,
                                          "rid": "ignored"})
                assert status == 200, out
                meta = out["meta_info"]
                assert len(out["output_ids"]) == meta["completion_tokens"] == len(meta["output_token_logprobs"])
                assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
                assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
                assert meta["finish_reason"]["type"] in ("stop", "length") and meta["prompt_tokens"] == 3
                assert meta["weight_version"] == 0
                again = (await post({"input_ids": [3, 4, 5], "sampling_params": sp}))[1]
                assert again["output_ids"] == out["output_ids"] and "output_token_logprobs" not in again["meta_info"]
                status, text = await post({"text": "2+2=", "sampling_params": {"max_new_tokens": 2}})
                assert status == 200 and isinstance(text["text"], str)
                for body, why in [({"text": "a", "input_ids": [1]}, "exactly one of 'text'"),
                                  ({"text": ["a", "b"]}, "one prompt per request"),
                                  ({"input_ids": [[1], [2]]}, "one non-empty list of token ids"),
                                  ({"text": "a", "stream": True}, "stream=true is not served"),
                                  ({"text": "a", "sampling_params": {"temprature": 1}}, "unknown sampling parameters"),
                                  ({"text": "a", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
                                  ([1, 2], "must be a JSON object")]:
                    status, err = await post(body)
                    assert status == 400 and why in err["error"]["message"], (body, err)
                json_type = {"Content-Type": "application/json"}
                async with session.post(url + "/generate", data=b"{", headers=json_type) as r:
                    assert r.status == 400
                async with session.post(url + "/generate", data=b"{}") as r:
                    assert r.status == 400 and "Content-Type: application/json" in (await r.json())["error"]["message"]
                async with session.get(url + "/health_generate") as r:
                    assert r.status == 200
                async with session.get(url + "/get_model_info") as r:
                    assert (await r.json())["model_path"] == policy
                async with session.get(url + "/nope") as r:
                    assert r.status == 404
        finally:
            await http.server.close()

    asyncio.run(main())


async def returns_a_list(args, sample, sampling_params):
    return [sample]


def sync_generate(args, sample, sampling_params):
    return sample


async def forgets_the_response(args, sample, sampling_params):
    sample.response_length = 3  # the prompt's three tokens, no response
    return sample


@pytest.mark.parametrize("fn,message", [
    ("returns_a_list", "returned a list: one sample per call is trained here"),
    ("forgets_the_response", r"sample.response_length must be an integer in \[0, 3\)"),
])
def test_a_functions_mistake_names_the_function_and_what_to_change(fn, message):
    path = f"tests.launcher.test_custom_rollout.{fn}"
    cfg = load_config(None, {"custom_generate_function_path": path, "hf_checkpoint": "x"})
    custom = CustomRollout(cfg, None)
    with pytest.raises(ValueError, match=f"--custom-generate-function-path {path}.* {message}"):
        asyncio.run(custom._one(given(), {"temperature": 1.0}))


def test_a_function_that_is_not_async_or_not_there_is_refused_at_start():
    with pytest.raises(ValueError, match="must be an async function generate\\(args, sample, sampling_params\\)"):
        CustomRollout(load_config(None, {"custom_generate_function_path": "tests.launcher.test_custom_rollout."
                                         "sync_generate"}), None)
    with pytest.raises(ValueError, match="has no function 'nope'"):
        CustomRollout(load_config(None, {"custom_generate_function_path": "tests.launcher.test_custom_rollout.nope"}),
                      None)


def test_the_function_is_given_the_prompt_as_the_policy_sees_it(policy):
    from transformers import AutoTokenizer

    from launcher.rl.rollout import RolloutPool

    tok = AutoTokenizer.from_pretrained(policy)
    row = Row(4, [{"role": "user", "content": "What is 2+2?"}], "4", metadata={"question": "2+2", "steps": [1]})
    for template in (True, False):
        cfg = load_config(None, {"apply_chat_template": template, "hf_checkpoint": policy,
                                 "custom_generate_function_path": "tests.launcher.test_custom_rollout.returns_a_list"})
        pool = RolloutPool(cfg, [], tok)
        s = CustomRollout(cfg, pool).first_sample(pool, row, "eval", 2, 5)
        assert s.tokens == pool.prompt_ids(row) and s.response_length == 0 and s.response == ""
        if template:  # the chat template's text, whose tokens are the policy's
            assert tok(s.prompt, add_special_tokens=False)["input_ids"] == s.tokens
        else:
            assert s.prompt == "What is 2+2?"
        assert s.metadata == {"question": "2+2", "label": "4", "steps": [1]} and s.status is Status.PENDING
        assert (s.index, s.dataset, s.group_index, s.weight_version) == (4, "eval", 2, 5)
    json.dumps(s.metadata)
