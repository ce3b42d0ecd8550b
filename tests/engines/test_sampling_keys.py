"""SGLang's further sampling keys (issue 17): validation, the torch engine's implementation on
tiny random models (fp32, CPU), the n-sample fan-out, and the SGLang adapter's pass-through."""

from __future__ import annotations

import asyncio
import collections
import math

import pytest
import torch
import transformers

from engines.builtin import TorchEngine
from engines.builtin.penalties import apply_penalties, min_p_mask
from engines.builtin.sample_kernels import seeded_uniform
from engines.builtin.sequence import Sequence
from engines.interface import MAX_INT64, MAX_N, SamplingParams, checked_sampling, fan_out, generate_n
from engines.models.model_builder import make_model
from tests.helpers import run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

GREEDY = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
REPEATED = [40] * 20  # a prompt of one repeated token: the tiny model's greedy output repeats it
NEW_KEYS_AT_DEFAULTS = {
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "min_new_tokens": 0,
    "skip_special_tokens": True,
    "no_stop_trim": False,
    "n": 1,
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model("qwen3", "tiny", str(tmp_path_factory.mktemp("models") / "qwen3-s1"), seed=1)


def prompts():
    return [[5 + (i * 7 + n) % 90 for i in range(n)] for n in (3, 9, 17, 30)]


def engine_run(model, fn, timeout=240):
    async def main():
        eng = TorchEngine(model, kv_cache_tokens=8192)
        try:
            return await fn(eng)
        finally:
            await eng.close()

    return run(main(), timeout)


def repeat_rate(prompt, out):
    """The fraction of generated tokens that already occurred in the prompt or before in the output."""
    seen, repeats = set(prompt), 0
    for t in out:
        repeats += t in seen
        seen.add(t)
    return repeats / len(out)


# ---------------------------------------------------------------------------- validation

BAD = [
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2]"),
    ({"repetition_penalty": 2.5}, "repetition_penalty must be in (0, 2]"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty must be a number in (0, 2]"),
    ({"repetition_penalty": True}, "repetition_penalty must be a number"),
    ({"frequency_penalty": 2.01}, "frequency_penalty must be in [-2, 2]"),
    ({"frequency_penalty": "1"}, "frequency_penalty must be a number in [-2, 2]"),
    ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2]"),
    ({"presence_penalty": float("-inf")}, "presence_penalty must be a number"),
    ({"min_p": 1.5}, "min_p must be in [0, 1]"),
    ({"min_p": -0.1}, "min_p must be in [0, 1]"),
    ({"min_p": None}, "min_p must be a number in [0, 1]"),
    ({"min_new_tokens": -1}, "min_new_tokens must be an integer in [0, max_new_tokens=128]"),
    ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens must be an integer in [0, max_new_tokens=5]"),
    ({"min_new_tokens": 1.0}, "min_new_tokens must be an integer"),
    ({"min_new_tokens": 2**70}, "min_new_tokens must be an integer >= 0; got an integer of 71 bits"),
    ({"skip_special_tokens": 1}, "skip_special_tokens must be true or false"),
    ({"skip_special_tokens": "false"}, "skip_special_tokens must be true or false"),
    ({"no_stop_trim": None}, "no_stop_trim must be true or false"),
    ({"n": 0}, f"n must be an integer in [1, {MAX_N}]"),
    ({"n": MAX_N + 1}, f"n must be an integer in [1, {MAX_N}]"),
    ({"n": 2.0}, f"n must be an integer in [1, {MAX_N}]"),
    ({"n": True}, f"n must be an integer in [1, {MAX_N}]"),
]


@pytest.mark.unit
@pytest.mark.parametrize("bad,message", BAD, ids=[repr(b) for b, _ in BAD])
def test_bad_values_of_the_new_keys_are_refused_naming_the_field(bad, message):
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict(bad)
    assert message in str(err.value) and len(str(err.value)) < 300, str(err.value)


@pytest.mark.unit
def test_the_ranges_sglang_accepts_are_accepted():
    sp = SamplingParams.from_dict(
        {
            "repetition_penalty": 2,
            "frequency_penalty": -2,
            "presence_penalty": 2,
            "min_p": 1,
            "min_new_tokens": 128,
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "n": MAX_N,
        }
    )
    assert (sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty, sp.min_p) == (2.0, -2.0, 2.0, 1.0)
    assert all(type(v) is float for v in (sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty, sp.min_p))
    assert sp.min_new_tokens == sp.max_new_tokens and sp.n == MAX_N and sp.penalized
    assert SamplingParams.from_dict({"repetition_penalty": 1e-9}).penalized
    defaults = SamplingParams()
    assert SamplingParams.from_dict(NEW_KEYS_AT_DEFAULTS) == defaults and not defaults.penalized


@pytest.mark.unit
def test_n_is_fanned_out_with_consecutive_seeds_and_refused_by_an_engine_request():
    with pytest.raises(ValueError, match=r"n must be 1 for one engine request, got 3.*generate_n"):
        checked_sampling({"n": 3})
    assert checked_sampling({"n": 1}).n == 1
    outs = fan_out({"n": 4, "seed": 10, "temperature": 0.7, "stop": ["x"]})
    assert [o.seed for o in outs] == [10, 11, 12, 13] and all(o.n == 1 and o.temperature == 0.7 for o in outs)
    outs[0].stop.append("y")  # copies, not shared lists
    assert outs[1].stop == ["x"]
    assert [o.seed for o in fan_out({"n": 3, "seed": MAX_INT64 - 1})] == [MAX_INT64 - 1, MAX_INT64, 0]
    assert [o.seed for o in fan_out({"n": 2})] == [None, None]
    assert len(fan_out(None)) == 1


# ---------------------------------------------------------------------------- the penalty arithmetic


def _seq(prompt, output, **sampling):
    seq = Sequence(0, list(prompt), SamplingParams(**sampling).validate(), None, None, None)
    seq.output = list(output)
    return seq


def _reference_row(logits, prompt, output, sp, eos):
    """SGLang's penalties on one row, token by token (frequency, presence, repetition, min_new_tokens)."""
    row = logits.clone()
    counts = collections.Counter(output)
    for t in range(row.numel()):
        if counts[t]:
            row[t] -= sp.frequency_penalty * counts[t] + sp.presence_penalty
        if counts[t] or t in prompt:
            row[t] = row[t] / sp.repetition_penalty if row[t] > 0 else row[t] * sp.repetition_penalty
    if len(output) < sp.min_new_tokens:
        for t in set(sp.stop_token_ids) | (set() if sp.ignore_eos else eos):
            row[t] = float("-inf")
    return row


@pytest.mark.unit
def test_batched_penalties_equal_sglangs_definition_row_by_row():
    torch.manual_seed(0)
    vocab, eos = 32, {2}
    logits = torch.randn(6, vocab) * 3
    seqs = [
        _seq([5, 6, 6], [7, 7, 8], repetition_penalty=1.7),
        _seq([5], [9, 9, 9, 5], frequency_penalty=0.6, presence_penalty=-0.4),
        _seq([1, 2, 3], [4, 4], temperature=0.0),  # no penalty: untouched
        _seq([10, 11], [12, 10, 12, 12], repetition_penalty=0.8, frequency_penalty=-1.5, presence_penalty=2.0),
        _seq([3], [14], min_new_tokens=4, stop_token_ids=[20, 21]),
        _seq([3], [14, 15], min_new_tokens=2, stop_token_ids=[20], presence_penalty=1.0),  # reached: no mask
    ]
    out = apply_penalties(logits, seqs, eos)
    for i, s in enumerate(seqs):
        ref = _reference_row(logits[i], s.prompt, s.output, s.sampling, eos)
        assert torch.allclose(out[i], ref, atol=1e-6), (i, out[i], ref)
    assert torch.equal(out[2], logits[2])
    assert out[4, 2] == out[4, 20] == out[4, 21] == float("-inf") and torch.isfinite(out[5]).all()
    # the counts follow the output as it grows (one token a step), and the input is never written
    before = logits.clone()
    seqs[1].output.append(9)
    out = apply_penalties(logits, seqs, eos)
    assert torch.equal(logits, before)
    assert torch.allclose(out[1], _reference_row(logits[1], seqs[1].prompt, seqs[1].output, seqs[1].sampling, eos))
    # a batch without penalties is the model's own tensor
    plain = [_seq([1], [], temperature=0.5), _seq([2], [3])]
    same = logits[:2]
    assert apply_penalties(same, plain, eos) is same


@pytest.mark.unit
def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_most_likely():
    logp = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0, -3.0], [2.0, 1.0, 0.0, -3.0]]), dim=-1)
    seqs = [_seq([1], [], temperature=1.0, min_p=0.3), _seq([1], [], temperature=1.0)]
    probs = logp.exp()
    drop = min_p_mask(logp, seqs)
    assert drop[0].tolist() == (probs[0] < 0.3 * probs[0].max()).tolist() == [False, False, True, True]
    assert not drop[1].any()
    assert min_p_mask(logp, seqs[1:]) is None


# ---------------------------------------------------------------------------- the engine


def test_without_the_new_keys_greedy_and_seeded_outputs_are_unchanged(model):
    """Greedy equals transformers' greedy, seeded sampling equals Gumbel-max over the
    seeded noise on transformers' logits, and the same requests with every new key set to
    its default, batched with penalized requests, give bit-identical tokens and logprobs."""
    seeded = {"temperature": 0.8, "seed": 7, "max_new_tokens": 16, "ignore_eos": True}
    truncated = {**seeded, "top_p": 0.9, "top_k": 20}
    greedy = {**GREEDY, "max_new_tokens": 16}
    penalized = [
        {**GREEDY, "repetition_penalty": 1.5, "frequency_penalty": 1.0},
        {**seeded, "seed": 99, "min_p": 0.2, "presence_penalty": 0.5, "min_new_tokens": 4, "ignore_eos": False},
    ]

    async def main(eng):
        ps = prompts()
        plain = await asyncio.gather(*(eng.generate(p, sp) for p in ps for sp in (greedy, seeded, truncated)))
        mixed = await asyncio.gather(
            *(eng.generate(p, {**sp, **NEW_KEYS_AT_DEFAULTS}) for p in ps for sp in (greedy, seeded, truncated)),
            *(eng.generate(p, sp) for p in ps for sp in penalized),
        )
        return plain, mixed[: len(plain)]

    plain, defaults = engine_run(model, main)
    for a, b in zip(plain, defaults):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.text == b.text
    hf = transformers.AutoModelForCausalLM.from_pretrained(model).eval()
    for i, p in enumerate(prompts()):
        g, s = plain[3 * i], plain[3 * i + 1]
        ids = torch.tensor([p])
        ref = hf.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert g.token_ids == ref[0, len(p) :].tolist()
        with torch.no_grad():
            logits = hf(torch.tensor([p + s.token_ids])).logits[0, len(p) - 1 : -1].double()
        n = len(s.token_ids)
        u = seeded_uniform(torch.full((n,), 7, dtype=torch.int64), torch.arange(n, dtype=torch.int64), logits.shape[-1])
        assert s.token_ids == (logits / 0.8 - torch.log(-torch.log(u))).argmax(-1).tolist()


def test_repetition_penalty_lowers_the_repeated_token_rate_of_greedy_decoding(model):
    async def main(eng):
        return await asyncio.gather(
            *(eng.generate(REPEATED, {**GREEDY, "repetition_penalty": r}) for r in (1.0, 1.3, 2.0, 0.5))
        )

    off, mild, strong, below_one = engine_run(model, main)
    assert off.token_ids[0] == REPEATED[0] and repeat_rate(REPEATED, off.token_ids) == 1.0
    # a token of the prompt is penalized from the first step: another token wins it
    assert mild.token_ids[0] not in REPEATED and strong.token_ids[0] not in REPEATED
    assert repeat_rate(REPEATED, strong.token_ids) < repeat_rate(REPEATED, mild.token_ids) < 1.0
    assert len(set(strong.token_ids)) > len(set(off.token_ids))
    assert below_one.token_ids == off.token_ids  # < 1 favours repeats: the greedy repeat stays


def test_frequency_and_presence_penalties_spread_the_output_over_more_tokens(model):
    keys = [
        {},
        {"frequency_penalty": 0.5},
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"presence_penalty": -2.0},
        {"frequency_penalty": -1.0},
    ]

    async def main(eng):
        return await asyncio.gather(*(eng.generate(REPEATED, {**GREEDY, **k}) for k in keys))

    off, freq_mild, freq, presence, presence_neg, freq_neg = engine_run(model, main)

    def most_common(r):
        return collections.Counter(r.token_ids).most_common(1)[0][1]

    assert most_common(off) == 48
    assert most_common(freq) < most_common(freq_mild) < most_common(off)  # stronger penalty, fewer repeats
    assert len(set(freq.token_ids)) > len(set(freq_mild.token_ids)) > len(set(off.token_ids))
    assert most_common(presence) < most_common(off) and repeat_rate(REPEATED, presence.token_ids) < 0.1
    assert presence_neg.token_ids == off.token_ids == freq_neg.token_ids  # negative: repeats favoured


def test_min_p_one_equals_greedy_and_min_p_sampling_stays_within_the_kept_set(model):
    async def main(eng):
        ps = prompts()
        greedy = await asyncio.gather(*(eng.generate(p, {**GREEDY, "max_new_tokens": 12}) for p in ps))
        sampled = {"temperature": 1.3, "max_new_tokens": 12, "ignore_eos": True, "min_p": 1.0}
        seeded = await asyncio.gather(*(eng.generate(p, {**sampled, "seed": 3 + i}) for i, p in enumerate(ps)))
        plain = await asyncio.gather(*(eng.generate(p, sampled) for p in ps))
        topk = await asyncio.gather(*(eng.generate(p, {**sampled, "top_k": 50, "seed": 1}) for p in ps))
        return greedy, seeded, plain, topk

    greedy, seeded, plain, topk = engine_run(model, main)
    for g, s, p, t in zip(greedy, seeded, plain, topk):
        assert g.token_ids == s.token_ids == p.token_ids == t.token_ids
        # log-probs stay those of softmax(logits / T) before truncation: below 0 at T = 1.3
        assert all(lp < 0 for lp in s.logprobs)


def test_min_new_tokens_prevents_an_early_stop(model):
    p = prompts()[0]

    async def main(eng):
        free = await eng.generate(p, {**GREEDY, "max_new_tokens": 12})
        first = free.token_ids[0]  # greedy emits it first: as a stop token it ends the request at once
        early = await eng.generate(p, {**GREEDY, "max_new_tokens": 12, "stop_token_ids": [first]})
        held = await eng.generate(p, {**GREEDY, "max_new_tokens": 12, "stop_token_ids": [first], "min_new_tokens": 5})
        eng.eos.add(first)  # the same through eos
        eos_early = await eng.generate(p, {"temperature": 0, "max_new_tokens": 12})
        eos_held = await eng.generate(p, {"temperature": 0, "max_new_tokens": 12, "min_new_tokens": 5})
        return first, early, held, eos_early, eos_held

    first, early, held, eos_early, eos_held = engine_run(model, main)
    assert early.token_ids == [first] and early.finish_reason == "stop"
    assert eos_early.token_ids == [first] and eos_early.finish_reason == "stop"
    for r in (held, eos_held):
        assert len(r.token_ids) > 5 and first not in r.token_ids[:5]
        assert r.finish_reason == "length" or r.token_ids[-1] == first


def test_no_stop_trim_keeps_the_stop_string_and_the_stop_token(model):
    p = prompts()[1]
    sampled = {"temperature": 1.0, "seed": 3, "max_new_tokens": 24, "ignore_eos": True}

    async def main(eng):
        free = await eng.generate(p, sampled)
        plain = [i for i, t in enumerate(free.token_ids) if 5 <= t < 100]  # printable characters (no specials)
        i = next(i for i in plain if i >= 2 and i + 1 in plain)
        stop_text = eng.tokenizer.decode(free.token_ids[i : i + 2])
        stop_id = free.token_ids[next(j for j in plain if j > i + 2)]
        runs = [
            {"stop": [stop_text]},
            {"stop": [stop_text], "no_stop_trim": True},
            {"stop_token_ids": [stop_id]},
            {"stop_token_ids": [stop_id], "no_stop_trim": True},
        ]
        out = await asyncio.gather(*(eng.generate(p, {**sampled, **k}) for k in runs))
        return stop_text, stop_id, eng.tokenizer, out

    stop_text, stop_id, tok, (trimmed, kept, id_trimmed, id_kept) = engine_run(model, main)

    def text(ids):
        return tok.decode(ids, skip_special_tokens=True)

    assert len(stop_text) == 2 and trimmed.finish_reason == kept.finish_reason == "stop"
    assert trimmed.token_ids == kept.token_ids
    assert kept.text == text(kept.token_ids) and kept.text.endswith(stop_text)
    assert trimmed.text == kept.text[: kept.text.find(stop_text)] and stop_text not in trimmed.text
    # a stop token: its text is left out unless no_stop_trim (as SGLang's detokenizer does)
    assert id_trimmed.token_ids == id_kept.token_ids and id_kept.token_ids[-1] == stop_id
    assert text([stop_id]) and id_kept.text == text(id_kept.token_ids)
    assert id_trimmed.text == text(id_trimmed.token_ids[:-1]) and id_kept.text == id_trimmed.text + text([stop_id])


def test_skip_special_tokens_false_keeps_special_tokens_in_the_text(model):
    # with repetition_penalty 2 the tiny model's greedy output turns to the special token </think>
    sp = {**GREEDY, "max_new_tokens": 24, "repetition_penalty": 2.0}

    async def main(eng):
        return await asyncio.gather(
            eng.generate(REPEATED, sp),
            eng.generate(REPEATED, {**sp, "skip_special_tokens": False}),
            eng.generate(REPEATED, {**sp, "skip_special_tokens": False, "stop": ["</think>"]}),
            eng.generate(REPEATED, {**sp, "stop": ["</think>"]}),
        )

    skipped, kept, stopped, not_stopped = engine_run(model, main)
    assert skipped.token_ids == kept.token_ids and 4 in kept.token_ids  # id 4: </think>
    assert "</think>" in kept.text and "</think>" not in skipped.text
    assert kept.text.replace("</think>", "") == skipped.text
    # stop strings are matched in the text as decoded for the request
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == 4 and "</think>" not in stopped.text
    assert not_stopped.finish_reason == "length"


def test_generate_n_fans_out_seeded_samples(model):
    p = prompts()[2]
    sp = {"temperature": 1.0, "seed": 21, "max_new_tokens": 10, "ignore_eos": True, "n": 3}

    async def main(eng):
        with pytest.raises(ValueError, match="n must be 1 for one engine request"):
            await eng.generate(p, sp)
        many = await generate_n(eng, p, sp)
        one_by_one = [await eng.generate(p, {**sp, "n": 1, "seed": 21 + j}) for j in range(3)]
        return many, one_by_one

    many, one_by_one = engine_run(model, main)
    assert [r.token_ids for r in many] == [r.token_ids for r in one_by_one]
    assert len({tuple(r.token_ids) for r in many}) == 3


def test_penalized_requests_survive_preemption_with_the_same_output(model):
    """A small KV cache preempts (and recomputes) requests: the counts stay with the request."""
    sp = {**GREEDY, "max_new_tokens": 40, "frequency_penalty": 0.7, "repetition_penalty": 1.2}

    async def main(eng):
        return [await eng.generate(p, sp) for p in prompts()]

    alone = engine_run(model, main)

    async def crowded():
        eng = TorchEngine(model, kv_cache_tokens=160, block_size=16)
        try:
            return await asyncio.gather(*(eng.generate(p, sp) for p in prompts()))
        finally:
            await eng.close()

    tight = run(crowded(), 240)
    for a, b in zip(alone, tight):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert not math.isnan(sum(alone[0].logprobs))


def test_a_top_p_below_float32s_range_keeps_the_most_likely_token(model):
    """top_p = 2.4e-206 is a valid (0, 1] value that reads as 0 in float32: once it emptied
    the kept set, NaN probabilities failed the whole engine step (found by the HTTP fuzz).
    It must sample the most likely token, i.e. greedy, seeded or not, batched with others."""

    async def main(eng):
        ps = prompts()
        greedy = await asyncio.gather(*(eng.generate(p, {**GREEDY, "max_new_tokens": 8}) for p in ps))
        tiny = {"temperature": 1.0, "top_p": 2.4149318564336552e-206, "max_new_tokens": 8, "ignore_eos": True}
        got = await asyncio.gather(*(eng.generate(p, {**tiny, "seed": i} if i % 2 else tiny) for i, p in enumerate(ps)),
                                   eng.generate(ps[0], {"temperature": 0.7, "max_new_tokens": 8}))
        return greedy, got[:-1]

    greedy, got = engine_run(model, main)
    assert [g.token_ids for g in got] == [g.token_ids for g in greedy]
