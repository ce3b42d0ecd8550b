"""The judge's integrity in a training job (docs/judge-reliability.md; the checks
themselves are in reward/integrity.py):

- before the first step, every judge instance scores the known pairs and the injection
  canaries through the training reward's own path, greedily (temperature 0: the check
  measures the judge, not its sampling); a judge that says 1 to a canary, or gets fewer
  than :data:`reward.integrity.SELF_CHECK_MIN_SHARE` of the known pairs right, stops the
  job (:class:`JudgeSelfCheckFailed` lists the misses; a judge that passes with misses is
  warned about, with them) unless ``--genrm-skip-self-check`` (then the job warns that its
  judge is unchecked);
- every ``--genrm-canary-interval`` steps the canaries are scored again (``judge/canary_*``);
- every step, the drift audit compares a sampled share of judge verdicts with the rule
  grader's (``audit/*``), writes the disagreements to ``RUN_DIR/judge_audit.jsonl`` and
  warns when the alarm goes on.

Only dapo-genrm verdicts are checked (``--rm-type dapo-genrm``, or the shipped Defer-swap
hook, which scores with the same prompt): a custom reward's or hook's judge prompt and
parsing are its own.
"""

from __future__ import annotations

import json
import os

from reward import integrity
from reward.dapo_genrm import question_and_label

SELF_CHECK_FILE = "judge_self_check.jsonl"
AUDIT_FILE = "judge_audit.jsonl"


#: the shipped Defer-swap hook (its package path, and the original's documented one): it scores
#: with reward/dapo_genrm.py's prompt and parsing
DAPO_GENRM_HOOKS = ("reward.examples.post_process_genrm_swap.custom_reward_post_process",
                    "examples.generate_reward_model.post_process_genrm_swap.custom_reward_post_process")


def judged_with_dapo_genrm(cfg) -> bool:
    """The job's rewards are dapo-genrm verdicts: ``--rm-type dapo-genrm`` scores them, or
    the shipped Defer-swap hook does (with the config's template, parse and variant)."""
    if cfg.custom_rm_path:
        return False
    hook = (cfg.custom_reward_post_process_path or "").replace(":", ".")
    return cfg.rm_type == "dapo-genrm" or hook in DAPO_GENRM_HOOKS


class JudgeSelfCheckFailed(RuntimeError):
    """A judge instance got known cases wrong before the first step."""


class JudgeIntegrity:
    """The self-check, the canaries and the drift audit of one job; inert when the job's
    reward is not the built-in judge reward."""

    def __init__(self, cfg, judge, rows: list, run_dir: str, out):
        self.cfg, self.judge, self.run_dir, self.out = cfg, judge, run_dir, out
        self.active = bool(judge.engines) and judged_with_dapo_genrm(cfg)
        variant, template = cfg.genrm_reward_variant, cfg.genrm_prompt_template
        self.rows = [question_and_label({"prompt": r.prompt, "label": r.label, "metadata": r.metadata})
                     for r in rows[:1000]]
        self.canaries = integrity.canaries(self.rows) if self.active else []
        self.audit = integrity.DriftAudit(cfg.genrm_audit_rate, cfg.genrm_audit_min_agreement,
                                          cfg.genrm_audit_max_gap, cfg.seed,
                                          integrity.answer_reader(variant, template, cfg.genrm_answer_guard),
                                          cfg.genrm_audit_grader if self.active else "rule")
        self.alarmed = False

    def _reward(self, instance: str, sampling_params: dict | None = None):
        from reward.rewards import judge_reward

        return judge_reward(self.cfg, judge_address=self.judge.address, route_key=instance,
                            sampling_params=sampling_params)

    def _write(self, name: str, rows: list[dict]) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, name), "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    async def self_check(self, step: int, judge_window) -> dict | None:
        """Score the known pairs (or ``--genrm-self-check-data``) and the canaries with every
        judge instance, in ``await judge_window(work)`` (which runs ``work()`` with the judge
        awake); the ``judge_check`` metrics record, or None when there is nothing to check.
        Results go to ``RUN_DIR/judge_self_check.jsonl``."""
        if not self.active:
            return None
        if self.cfg.genrm_skip_self_check:
            print("relay: WARNING: the judge was NOT checked before training (genrm_skip_self_check / "
                  "--genrm-skip-self-check): its rewards are trusted as they come", file=self.out, flush=True)
            return None
        return await judge_window(lambda: self._check_every_instance(step))

    async def _check_every_instance(self, step: int) -> dict:
        cfg = self.cfg
        if cfg.genrm_self_check_data:
            checks = integrity.load_checks(cfg.genrm_self_check_data)
        else:
            checks = integrity.known_pairs(self.rows, cfg.genrm_reward_variant)
        checks += self.canaries
        record: dict = {"kind": "judge_check", "step": step}
        before, counts = await self._engine_requests(), await self.judge.counts()
        misses, failed = [], False
        for instance in cfg.genrm:
            results = await integrity.run_checks(checks, self._reward(instance, {"temperature": 0.0}))
            self._write(SELF_CHECK_FILE, [{"step": step, "instance": instance, **r} for r in results])
            wrong = [r for r in results if not r["ok"]]
            misses += [(instance, r) for r in wrong]
            failed = failed or not integrity.self_check_passes(results)
            record[f"judge/self_check_passed/{instance}"] = len(results) - len(wrong)
            record[f"judge/self_check_total/{instance}"] = len(results)
        record.update(self._canary_metrics([r for _, r in misses], len(self.canaries) * len(cfg.genrm)))
        record["judge/self_check_engine_requests"] = [b - a for a, b in zip(before, await self._engine_requests())]
        record["judge/requests"] = (await self.judge.counts())["requests"] - counts["requests"]
        if failed:
            raise JudgeSelfCheckFailed(self._failure_message(misses, len(checks)))
        print(f"judge self-check passed: {len(checks)} cases x {len(cfg.genrm)} instance(s) "
              f"({len(self.canaries)} injection canaries)", file=self.out, flush=True)
        if misses:
            print("relay: WARNING: " + self._failure_message(misses, len(checks), passed=True), file=self.out,
                  flush=True)
        return record

    async def _engine_requests(self) -> list[int]:
        """Requests each judge engine finished so far (the cases spread over an instance's
        engines by least-loaded dispatch: the record shows how many each answered)."""
        from .engine_pool import call_engines

        return [s.get("requests_finished", 0) for s in await call_engines(self.judge.engines, "stats")]

    def _failure_message(self, failures: list, total: int, passed: bool = False) -> str:
        rule = (f"(it passes with no canary said 1 and at least {integrity.SELF_CHECK_MIN_SHARE:.0%} of the known "
                "pairs right, asked greedily)")
        if passed:
            lines = [f"the judge passed its self-check with {len(failures)} of {total} cases wrong {rule}:"]
        else:
            lines = [f"the judge failed its self-check before the first step ({len(failures)} of {total} cases wrong "
                     f"over {len(self.cfg.genrm)} instance(s)) {rule}; training on its rewards would optimize its "
                     "mistakes:"]
        for instance, r in failures[:12]:
            why = f", {r['format_error']}" if r["format_error"] else ""
            lines.append(f"  [{instance}] {r['kind']}: label {r['label']!r}, response {r['response'][:80]!r} -> "
                         f"verdict {r['verdict']} (expected {r['expected']}{why}), judge said "
                         f"{r['judge_response'][:80]!r}")
        lines.append(f"All results: {os.path.join(self.run_dir, SELF_CHECK_FILE)}. Check --genrm-prompt-template, "
                     "--genrm-parse and the judge checkpoint" +
                     ("" if passed else "; --genrm-skip-self-check trains anyway (not advised)"))
        return "\n".join(lines)

    @staticmethod
    def _canary_metrics(wrong: list[dict], total: int) -> dict:
        flipped = sum(1 for r in wrong if r["kind"].startswith("canary:"))
        return {"judge/canaries": total, "judge/canaries_flipped": flipped,
                "judge/canary_pass_rate": 1 - flipped / total if total else 1.0}

    async def canaries_due(self, step: int) -> dict:
        """Every ``--genrm-canary-interval`` steps (the judge must be awake): the canaries
        scored again by the default instance, ``judge/canary_*``; a flip warns."""
        interval = self.cfg.genrm_canary_interval
        if not self.active or not interval or (step + 1) % interval:
            return {}
        results = await integrity.run_checks(self.canaries, self._reward(next(iter(self.cfg.genrm))))
        wrong = [r for r in results if not r["ok"]]
        self._write(SELF_CHECK_FILE, [{"step": step, "instance": next(iter(self.cfg.genrm)), **r} for r in results])
        if wrong:
            print(f"relay: WARNING: step {step}: the judge said 1 to {len(wrong)} of {len(results)} injection canaries "
                  f"(first: {wrong[0]['kind']}, response {wrong[0]['response'][:80]!r}); see "
                  f"{os.path.join(self.run_dir, SELF_CHECK_FILE)}", file=self.out, flush=True)
        return self._canary_metrics(wrong, len(results))

    def audit_step(self, step: int, samples: list) -> dict:
        """The drift audit of a scored batch: ``audit/*`` metrics; disagreements appended to
        ``RUN_DIR/judge_audit.jsonl``; a warning when the alarm goes on."""
        if not self.active or not self.cfg.genrm_audit_rate:
            return {}
        metrics, disagreements = self.audit.audit(step, samples)
        if disagreements:
            self._write(AUDIT_FILE, disagreements)
        if metrics["audit/alarm"] and not self.alarmed:
            m = metrics
            print(f"relay: WARNING: judge drift at step {step}: judge and rule grader agree on "
                  f"{m['audit/agreement']:.0%} of {m['audit/window_samples']} audited samples over the last "
                  f"{integrity.AUDIT_WINDOW} steps (judge accuracy {m['audit/judge_accuracy']:.2f}, rule accuracy "
                  f"{m['audit/rule_accuracy']:.2f}); examples in {os.path.join(self.run_dir, AUDIT_FILE)}",
                  file=self.out, flush=True)
        self.alarmed = bool(metrics["audit/alarm"])
        return metrics
