"""The original documentation's agentic example ("Agentic Example: Routing by Module"): each
step of an agent's trajectory is judged by the judge of the module that produced it.

``agentic_reward_func`` is the documented function as written there (only the judge
client's import line differs); ``_format_step_messages`` and ``_parse_judgement``, which
the documentation leaves to the user, are ours. Use with
``--custom-rm-path examples.generate_reward_model.agentic_routing.agentic_reward_func`` and
``--genrm-instances '{"planner_judge": {...}, "tool_call_judge": {...}, "final_answer_judge": {...}}'``.

A sample's ``metadata["trajectory_steps"]`` is a list of ``{"module": "plan" | "tool_call" |
"final_answer", "input": str, "output": str}`` (the data row's metadata, or what an agentic
rollout puts there).
"""

from __future__ import annotations

import re

from reward.client import get_genrm_client

STEP_PROMPT = """You are judging one step of an AI agent's trajectory, produced by its {module} module.

[Step input]: {input}
[Step output]: {output}

If the step's output is correct and useful for its input, the Judgement is 1; otherwise it is 0. Output only the \
Judgement (1 or 0).
Judgement:"""

_BIT = re.compile(r"(?<![\w.])([01])(?![\w.])")


def _format_step_messages(step: dict) -> list[dict]:
    content = STEP_PROMPT.format(module=step["module"], input=step.get("input", ""), output=step.get("output", ""))
    return [{"role": "user", "content": content}]


def _parse_judgement(judge_response: str) -> float:
    """Loose: the last standalone 0 or 1 after the last "Judgement:" (else in the whole
    reply); 0.0 when there is none."""
    bits = _BIT.findall(judge_response.split("Judgement:")[-1])
    return float(bits[-1]) if bits else 0.0


# ---- from here on, the documentation's text (only the import line above differs)

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
