"""The demo's synthetic task and its data files (no downloads).

Policy task: "What is N mod 10?" for 2- to 4-digit N; the answer is one digit. Train and
held-out prompts use disjoint N. The judge's task: given a reference digit and a model's
answer (a digit, or a few characters), decide whether they match; it restates both and ends
with 1 or 0 (:func:`judge_response`). Its prompt is the compact :data:`JUDGE_TEMPLATE` (a
tiny character-level judge cannot learn to read the long dapo-genrm prompt in the minutes
the demo has), passed to the job as ``--genrm-prompt-template``.
"""

from __future__ import annotations

import json
import os
import random
import string

JUDGE_TEMPLATE = "Answer: {answer}\nReference: {label}"


def question(n: int) -> str:
    return f"What is {n} mod 10?"


def _write(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


#: Characters a drifting policy emits instead of a digit (its tokenizer's printable
#: characters without digits and whitespace): the judge must answer 0 to each of them.
JUNK = string.ascii_letters + string.punctuation

#: Words a rambling policy (or a prompt injection) writes where the answer should be: the
#: judge must answer 0 to a sentence, not only to a character.
WORDS = ("the", "answer", "is", "so", "it", "must", "be", "above", "below", "output", "two", "check", "I",
         "think", "not", "sure", "result", "equals", "both", "and", "all", "step", "mod", "ten", "final",
         "same", "consistent", "correct", "wrong", "say", "write", "reply", "please", "we", "get", "then")

#: Answers longer than this are restated cut to this many characters (:func:`judge_response`).
RESTATED_CHARS = 3


def _sentence(rng: random.Random) -> str:
    """A few words, digits among them, some punctuation: 4 to 64 characters."""
    words = [rng.choice(WORDS) if rng.random() < 0.85 else rng.choice("0123456789") for _ in range(rng.randint(2, 14))]
    text = " ".join(words)[:63].rstrip()
    if rng.random() < 0.5:
        text = text[0].upper() + text[1:] + rng.choice(".!:,")
    return text if len(text) > RESTATED_CHARS else text + " " + rng.choice(WORDS)


def _judge_answer(rng: random.Random, label: str) -> str:
    """40% matching answers; the rest other digits, two-digit strings, sentences, and junk:
    nothing, non-digit characters, or a digit with something around it. A policy trained
    against the judge looks for answers the judge wrongly accepts, and the judge's
    self-check sends it sentences, so every kind of output a tiny policy can produce must
    be in the judge's training data."""
    r = rng.random()
    if r < 0.4:
        return label
    if r < 0.7:
        return rng.choice([d for d in "0123456789" if d != label])
    if r < 0.76:
        return rng.choice("0123456789") + rng.choice("0123456789")
    if r < 0.82:
        return _sentence(rng)
    k = rng.random()
    if k < 0.15:
        return ""
    if k < 0.55:
        return rng.choice(JUNK)
    if k < 0.75:
        return rng.choice(JUNK) + rng.choice(JUNK + "0123456789")
    return rng.choice([label + label, "1" + label, label + "0", label + rng.choice(JUNK), rng.choice(JUNK) + label])


def judge_response(answer: str, label: str) -> str:
    """The judge's reply: it restates the answer and the reference, then gives its verdict
    (read with ``--genrm-parse loose``: the last standalone 0/1). Restating first turns a
    long-range comparison into a local one, which a 2-layer model learns in minutes. An
    answer longer than :data:`RESTATED_CHARS` (a sentence: never a one-digit reference) is
    restated cut to that many characters."""
    return f"{answer[:RESTATED_CHARS]} {label} {1 if answer == label else 0}"


def write_demo_data(root: str, seed: int = 0) -> dict[str, str]:
    """All the demo's JSONL files under ``root``; returns their paths by name."""
    from reward.dapo_genrm import judge_messages

    os.makedirs(root, exist_ok=True)
    rng = random.Random(seed)
    numbers = list(range(10, 10000))
    rng.shuffle(numbers)
    held, train = numbers[:200], numbers[200:]
    paths = {
        "train": _write(
            os.path.join(root, "train.jsonl"),
            [{"prompt": [{"role": "user", "content": question(n)}], "label": str(n % 10)} for n in train],
        ),
        "eval": _write(
            os.path.join(root, "eval.jsonl"),
            [{"prompt": [{"role": "user", "content": question(n)}], "label": str(n % 10)} for n in held],
        ),
        "policy_sft": _write(
            os.path.join(root, "policy_sft.jsonl"), [{"prompt": question(n), "response": str(n % 10)} for n in train]
        ),
        "policy_sft_eval": _write(
            os.path.join(root, "policy_sft_eval.jsonl"),
            [{"prompt": question(n), "response": str(n % 10)} for n in held],
        ),
    }

    def judge_rows(k: int, r: random.Random) -> list[dict]:
        rows = []
        for _ in range(k):
            label = str(r.randrange(10))
            answer = _judge_answer(r, label)
            msgs = judge_messages("", label, f"Answer: {answer}", JUDGE_TEMPLATE)
            rows.append({"prompt": msgs, "response": judge_response(answer, label)})
        return rows

    paths["judge_sft"] = _write(os.path.join(root, "judge_sft.jsonl"), judge_rows(20000, random.Random(seed + 1)))
    paths["judge_sft_eval"] = _write(
        os.path.join(root, "judge_sft_eval.jsonl"), judge_rows(400, random.Random(seed + 2))
    )
    return paths
