"""Every timeout of the RL loop and of SFT, in seconds, in one place.

A timeout bounds how long the controller waits for one remote call before the job fails
with :class:`relay.CallTimeout`; it never cuts a healthy call short in practice, so each is
sized for the slowest legitimate case (a large model on a loaded machine).
"""

#: a trainer or engine loads its model and answers ``initialized``
MODEL_LOAD = 900
#: the judge service process starts and reaches its engines
JUDGE_SERVICE_START = 300
#: weights and caches move between GPU and CPU: trainer onload / offload, engine sleep / wake
MEMORY_MOVE = 600
#: any other call made to every engine at once (stats, sleep, wake)
ENGINE_CALL = 600
#: small control calls: judge admission, the gateway's start, metrics snapshots, GPU memory
#: figures, aborting generations, trainer shutdown
CONTROL = 60
#: the engines' event logs at close; after a failure an engine may be on a dead node
EVENT_LOG = 30
EVENT_LOG_AFTER_FAILURE = 3
#: with fault tolerance: a dead engine's successor starts and has the current weights
ENGINE_REBUILD = 900
#: one sample's generation
GENERATE = 1800
#: the one-token probe after a weight sync
PROBE = 300
#: one call of a train / log-prob / SFT step on a trainer rank
TRAIN_CALL = 3600
#: the trainer pushes its weights into every rollout engine
PUSH_WEIGHTS = 1800
#: a checkpoint written or read, an HF export gathered
CHECKPOINT = 1800
#: fully-async drain: the aborted in-flight groups finish scoring
DRAIN = 120
