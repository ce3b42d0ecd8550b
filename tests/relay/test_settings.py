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
    assert "job_secret=" not in repr(Settings(job_secret="abcd")) and "abcd" not in repr(Settings(job_secret="abcd"))


def test_each_layer_declares_its_variables_beside_its_code_and_parses_them_alike(monkeypatch):
    from engines.settings import settings as engines
    from launcher.settings import LAYERS, check_all

    e = engines.parse({})
    assert e.engine_cpu_threads == 1 and e.trainer_cpu_threads == 0 and e.cache == ".cache"  # the trainer's: per job
    with pytest.raises(ValueError, match="RELAY_ENGINE_CPU_THREADS must be a number of threads >= 1"):
        engines.parse({"RELAY_ENGINE_CPU_THREADS": "0"})
    with pytest.raises(ValueError, match=r"RELAY_TRAINER_CPU_THREADS must be a number of threads \(0: chosen"):
        engines.parse({"RELAY_TRAINER_CPU_THREADS": "-1"})
    assert engines.parse({"RELAY_TRAINER_CPU_THREADS": "2"}).trainer_cpu_threads == 2
    names = [v.name for v in VARIABLES] + [v.name for layer in LAYERS for v in layer.variables]
    assert len(names) == len(set(names))  # each variable belongs to one layer
    monkeypatch.setenv("RELAY_ENGINE_CPU_THREADS", "3")
    assert engines().engine_cpu_threads == 3
    monkeypatch.setenv("RELAY_AGENT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="RELAY_AGENT_TIMEOUT must be a number of seconds"):
        check_all()


def test_settings_follow_the_environment(monkeypatch):
    monkeypatch.setenv("RELAY_CALL_TIMEOUT", "7")
    assert relay.settings().call_timeout == 7.0
    monkeypatch.setenv("RELAY_CALL_TIMEOUT", "8")
    assert relay.settings().call_timeout == 8.0


def test_every_relay_variable_the_code_names_is_in_the_table_and_the_docs():
    from launcher.settings import LAYERS

    known = {v.name for v in VARIABLES} | {name for name, _ in OTHER_VARIABLES}
    known |= {v.name for layer in LAYERS for v in layer.variables}
    named = set()
    for pkg in ("relay", "engines", "reward", "launcher"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    with open(os.path.join(dirpath, f)) as fh:
                        named |= set(re.findall(r"[\"'](RELAY_[A-Z_]+)[\"'=]", fh.read()))
    assert named <= known, named - known
    with open(os.path.join(ROOT, "docs/relay.md")) as f:
        assert markdown_table(LAYERS) in f.read()


def test_log_level_sets_the_relay_logging_tree_here_and_in_spawned_workers(tmp_path):
    """--log-level (RELAY_LOG_LEVEL): the relay.* records at that level reach stderr, one line
    each with time, level and logger, in the process that set it and in the workers it spawns."""
    import subprocess
    import sys

    script = tmp_path / "logs.py"
    script.write_text(
        "import logging, relay\n"
        "from relay import Actor, endpoint\n"
        "class Talker(Actor):\n"
        "    @endpoint\n"
        "    async def talk(self) -> None:\n"
        "        logging.getLogger('relay.test').info('from the worker')\n"
        "        logging.getLogger('relay.test').debug('not at info')\n"
        "async def main():\n"
        "    relay.configure_logging()\n"
        "    logging.getLogger('relay.test').info('from the root')\n"
        "    procs = relay.this_host().spawn_procs(per_host={'procs': 1})\n"
        "    talker = procs.spawn('talker', Talker)\n"
        "    await talker.talk.call_one().result(60)\n"
        "    await procs.stop()\n"
        "if __name__ == '__main__':\n"
        "    import asyncio; asyncio.run(main())\n")
    env = dict(os.environ, RELAY_LOG_LEVEL="info", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if "relay.test" in line]
    assert [line.split(" ", 1)[1] for line in lines] == ["INFO relay.test: from the root",
                                                         "INFO relay.test: from the worker"], p.stderr[-2000:]
    quiet = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=dict(env, RELAY_LOG_LEVEL=""),
                           capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0 and "relay.test" not in quiet.stderr  # default: warning, as quiet as before
