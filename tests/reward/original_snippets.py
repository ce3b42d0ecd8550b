"""The original system's GenRM documentation snippets, verbatim (its text, incl. its import
line ``from relax.utils.genrm_client import get_genrm_client``), for the tests that run them
here with only that line changed (:func:`ported`). Source: the original's GenRM example
documentation ("Calling a Specific Instance: route_key", "Agentic Example: Routing by
Module", "Reward Configuration", "Use GenRMClient in Python")."""

from __future__ import annotations

ORIGINAL_IMPORT = "from relax.utils.genrm_client import get_genrm_client"
OUR_IMPORT = "from reward.client import get_genrm_client"

ROUTE_KEY_SNIPPET = '''\
from relax.utils.genrm_client import get_genrm_client

genrm_client = get_genrm_client()

quality_response = await genrm_client.generate(
    messages=[{"role": "user", "content": "Judge correctness..."}],
    route_key="quality",
)
safety_response = await genrm_client.generate(
    messages=[{"role": "user", "content": "Judge safety..."}],
    route_key="safety",
)
'''

AGENTIC_SNIPPET = '''\
# --genrm-instances '{"planner_judge": {...}, "tool_call_judge": {...}, "final_answer_judge": {...}}'

MODULE_TO_ROUTE_KEY = {
    "plan": "planner_judge",
    "tool_call": "tool_call_judge",
    "final_answer": "final_answer_judge",
}

async def agentic_reward_func(args, sample, **kwargs) -> dict:
    genrm_client = get_genrm_client()
    per_step_scores = []
    for step in sample.metadata["trajectory_steps"]:
        route_key = MODULE_TO_ROUTE_KEY[step["module"]]
        judge_response = await genrm_client.generate(
            messages=_format_step_messages(step),
            route_key=route_key,
        )
        per_step_scores.append(_parse_judgement(judge_response))

    # Aggregation is entirely up to you: weighted average, min() for a
    # "weakest-link" penalty, or scoring only the final step and treating
    # earlier ones as process reward — Relax does not prescribe one.
    return {"score": sum(per_step_scores) / len(per_step_scores)}
'''

DAPO_GENRM_SNIPPET = '''\
DAPO_GENRM_PROMPT_TEMPLATE = """Below are two answers to a question. ...
[Question]: {question}
[Standard Answer]: {ground_truth}
[Model_answer] : {predict_str}
Judgement:"""

def _format_messages(question, ground_truth, predict_str):
    # Extract answer after "Answer:" marker, or take last 300 chars
    if "Answer:" in predict_str:
        predict_str = predict_str.split("Answer:")[-1]
    else:
        predict_str = predict_str[-300:]
    prompt = DAPO_GENRM_PROMPT_TEMPLATE.format(
        question=question, ground_truth=ground_truth, predict_str=predict_str,
    )
    return [{"role": "user", "content": prompt}]

async def async_compute_score_genrm(args, sample) -> dict:
    genrm_client = get_genrm_client()          # singleton HTTP client
    question = sample.metadata.get("question", "")
    ground_truth = sample.metadata.get("label", "")
    messages = _format_messages(question, ground_truth, sample.response)

    response = await genrm_client.generate(messages)  # call GenRM service
    prediction = response.strip()

    # Strict equality: only exact "1" yields a positive score
    score = 1.0 if prediction == "1" else 0.0
    return {"score": score, "acc": int(score), "pred": prediction}
'''

CLIENT_SNIPPET = '''\
from relax.utils.genrm_client import get_genrm_client

# Get singleton client (avoids per-request client creation overhead)
client = get_genrm_client()

# Async generate
response = await client.generate(
    messages=[{"role": "user", "content": "Evaluate..."}],
    sampling_params={"temperature": 0.2},
)
print(response)  # "1" or "0"
'''


def ported(snippet: str) -> str:
    """The snippet with its judge-client import line replaced by ours (added first when the
    snippet has none: the agentic and dapo-genrm snippets use ``get_genrm_client`` without
    showing its import)."""
    if ORIGINAL_IMPORT in snippet:
        assert snippet.count(ORIGINAL_IMPORT) == 1
        return snippet.replace(ORIGINAL_IMPORT, OUR_IMPORT)
    return OUR_IMPORT + "\n" + snippet
