"""relay.settings(): every RELAY_* variable parsed in one place, and listed in docs/relay.md."""

from __future__ import annotations

import os
import re

import pytest

import relay
from relay._settings import OTHER_VARIABLES, VARIABLES, Settings, markdown_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_values_parse_to_their_types_and_unset_ones_take_their_defaults():
    s = Settings.from_env(
        {"RELAY_HEARTBEAT_TIMEOUT": "2", "RELAY_SHM": "0", "RELAY_LISTEN": "tcp", "RELAY_SYS_PATH": "/a:/b"}
    )
    assert s.heartbeat_timeout == 2.0 and s.shm is False and s.listen_tcp is True and s.sys_path == ("/a", "/b")
    assert s.host == "127.0.0.1" and s.call_timeout == 600.0
    assert Settings.from_env({}) == Settings()
    with pytest.raises(ValueError, match="RELAY_HEARTBEAT_TIMEOUT must be > 0"):
        Settings.from_env({"RELAY_HEARTBEAT_TIMEOUT": "0"})
    with pytest.raises(ValueError, match="RELAY_SHM_MIN_BYTES must be an integer"):
        Settings.from_env({"RELAY_SHM_MIN_BYTES": "lots"})
    assert s.engine_cpu_threads == 1 and s.trainer_cpu_threads == 0  # the trainer's: chosen per job
    with pytest.raises(ValueError, match="RELAY_ENGINE_CPU_THREADS must be a number of threads >= 1"):
        Settings.from_env({"RELAY_ENGINE_CPU_THREADS": "0"})
    with pytest.raises(ValueError, match=r"RELAY_TRAINER_CPU_THREADS must be a number of threads \(0: chosen"):
        Settings.from_env({"RELAY_TRAINER_CPU_THREADS": "-1"})
    assert Settings.from_env({"RELAY_TRAINER_CPU_THREADS": "2"}).trainer_cpu_threads == 2
    assert "job_secret=" not in repr(Settings(job_secret="abcd")) and "abcd" not in repr(Settings(job_secret="abcd"))


def test_settings_follow_the_environment(monkeypatch):
    monkeypatch.setenv("RELAY_CALL_TIMEOUT", "7")
    assert relay.settings().call_timeout == 7.0
    monkeypatch.setenv("RELAY_CALL_TIMEOUT", "8")
    assert relay.settings().call_timeout == 8.0


def test_every_relay_variable_the_code_names_is_in_the_table_and_the_docs():
    known = {v.name for v in VARIABLES} | {name for name, _ in OTHER_VARIABLES}
    named = set()
    for pkg in ("relay", "engines", "reward", "launcher"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    with open(os.path.join(dirpath, f)) as fh:
                        named |= set(re.findall(r"[\"'](RELAY_[A-Z_]+)[\"'=]", fh.read()))
    assert named <= known, named - known
    with open(os.path.join(ROOT, "docs/relay.md")) as f:
        assert markdown_table() in f.read()
