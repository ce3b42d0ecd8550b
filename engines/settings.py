"""The engines' ``RELAY_*`` environment variables (relay's :class:`~relay.Layer` shape; docs/relay.md
lists every layer's): ``settings()`` gives their values."""

from __future__ import annotations

from relay.variables import Layer, Variable, flag_off, integer, seconds, text, threads_from

VARIABLES = (
    Variable("RELAY_CACHE", "cache", ".cache", text, "engines",
             "models, data and demo runs are kept under this directory (tiny models are built there on first use)"),
    Variable("RELAY_ENGINE_CPU_THREADS", "engine_cpu_threads", 1, threads_from(1, ">= 1"), "engines",
             "intra-op threads of a CPU engine's step"),
    Variable("RELAY_TRAINER_CPU_THREADS", "trainer_cpu_threads", 0, threads_from(0, "(0: chosen for you)"), "engines",
             "intra-op threads of each CPU trainer rank (0: 1 in relay train, whose workers share the cores; "
             "the cores shared out among the ranks in relay sft)"),
    Variable("RELAY_TRAINER_FUSIONS", "trainer_fusions", True, flag_off, "engines",
             "0: the trainer runs megatron-core's unfused RoPE, SwiGLU and RMSNorm instead of its fused "
             "kernels (for comparisons)"),
    Variable("RELAY_DECODE_PDL", "decode_pdl", True, flag_off, "engines",
             "0: the built-in engine's decode kernels launch without programmatic dependent launch on Hopper "
             "(for comparisons)"),
    Variable("RELAY_SGLANG_LAUNCH", "sglang_launch", "sglang.launch_server", text, "engines",
             "the module the SGLang engine runs to start its server"),
    Variable("RELAY_DIST_INIT_TIMEOUT", "dist_init_timeout", 60.0, seconds, "engines",
             "seconds the trainer's torch.distributed rendezvous may take"),
    Variable("RELAY_BUNDLE", "bundle", -1, integer, "engines", "the bundle a worker hosts (set for each worker)"),
    Variable("RELAY_NODE", "node", -1, integer, "engines", "the node a worker runs on (set for each worker)"),
)
settings = Layer("engines", "launcher / you", VARIABLES)
