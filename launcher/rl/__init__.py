"""The RL loop as a small package; launcher/rl/loop.py is the file to read first.

loop.py            the GRPO loop: run, one step as named calls, fully-async
evaluation.py      evaluation on the held-out prompts
integrity.py       the judge's self-check, canaries and drift audit in a job
sample.py          the typed Sample and the bookkeeping over lists of samples
scoring.py         rewards, the checks on them, advantages, reward metrics
rollout.py         the rollout pool: engines, sleep/wake, generating a group, prompt tokens
async_rollout.py   the fully-async group producer and its bound
judge.py           the judge: service, gateway, sleep/wake with admission, counters
trainer_group.py   the trainer group shared with SFT
engine_pool.py     spawning and calling engines, their event logs
startup.py         starting every role in the order the layout needs
checkpoints.py     checkpoints, resume, StoppedWithCheckpoint
timing.py          the phase timer (time/* metrics)
timeouts.py        every timeout, named
"""
