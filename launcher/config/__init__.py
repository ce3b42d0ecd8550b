"""The job's configuration as one concept: its schema (:mod:`.schema`: the typed
``JobConfig``, one field per flag), the rules a value must follow and the original system's
flag names (:mod:`.rules`), loading YAML and flags (:mod:`.loading`), the checks a start
makes before any process exists (:mod:`.checks`: training maths, user code, the built-in
engine's options) and the files and models a job reads (:mod:`.paths`)."""

from launcher.config.loading import SHIPPED_CONFIGS, build_config, load_config, parse_overrides
from launcher.config.rules import ConfigError, GenRMInstance
from launcher.config.schema import FIELDS, JobConfig

__all__ = ["FIELDS", "SHIPPED_CONFIGS", "ConfigError", "GenRMInstance", "JobConfig", "build_config", "load_config",
           "parse_overrides"]
