"""User code named by module.func flags (--custom-rm-path, --custom-reward-post-process-path):
resolved from the working directory first, as ``python -m`` would, by the installed ``relay``
console script too (and inherited by the processes a job starts); a path that cannot be
imported fails every entry point before any process starts, naming the flag, the module and
the directories searched. Also: config checks a job needs before it starts, and the help
of the subcommands that take config flags."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from launcher.config import FIELDS, ConfigError, load_config
from launcher.config.checks import check_job, user_code_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: the installed console script, exactly what a user types (not ``python -m launcher.cli``)
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")
HOOK = "custom_reward_post_process"
pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def user_env() -> dict:
    """The test's environment without a user directory chosen in advance."""
    env = dict(os.environ)
    env.pop("RELAY_USER_PATH", None)
    return env


def write_user_package(cwd) -> None:
    """``examples/cwd_hook.py`` in ``cwd``, a directory on no import path: importing it leaves
    a marker naming the importing process, so the test sees who imported it."""
    pkg = cwd / "examples"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cwd_hook.py").write_text(
        "import os\n"
        "open(os.path.join(os.path.dirname(os.path.dirname(__file__)), 'imported-by'), "
        "'a').write(f'{os.getpid()}\\n')\n"
        f"def {HOOK}(args, samples):\n"
        "    return [0.0] * len(samples), [0.0] * len(samples)\n"
        "def reward(args, sample):\n"
        "    return 0.0\n"
    )
    (pkg / "broken.py").write_text("raise RuntimeError('the module itself is broken')\n")


def relay(cwd, *args, timeout: float = 60) -> subprocess.CompletedProcess:
    assert os.path.exists(RELAY), f"the relay console script is not installed next to {sys.executable}"
    return subprocess.run([RELAY, *args], cwd=cwd, env=user_env(), capture_output=True, text=True, timeout=timeout)


def test_console_script_imports_an_examples_hook_from_the_working_directory(tmp_path):
    write_user_package(tmp_path)
    p = relay(
        tmp_path, "plan", "--config", "tiny-cpu-defer", "--custom-reward-post-process-path", f"examples.cwd_hook.{HOOK}"
    )
    assert p.returncode == 0, p.stderr
    assert "Shared defer-swap" in p.stdout
    assert (tmp_path / "imported-by").read_text().split() != []  # validated by importing it, from the cwd
    p = relay(tmp_path, "plan", "--config", "tiny-cpu-split", "--custom-rm-path", "examples.cwd_hook.reward")
    assert p.returncode == 0, p.stderr


def test_processes_of_a_job_inherit_the_working_directory_on_their_path(tmp_path):
    """relay train from a directory: its workers get that directory first on their import
    path (RELAY_USER_PATH, PYTHONPATH, and relay's RELAY_SYS_PATH)."""
    write_user_package(tmp_path)
    p = subprocess.Popen(
        [
            RELAY,
            "train",
            "--config",
            "tiny-cpu-defer",
            "--custom-reward-post-process-path",
            f"examples.cwd_hook.{HOOK}",
            "--hold",
            "60",
        ],
        cwd=tmp_path,
        env=user_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        tag = os.environ["RELAY_TEST_TAG"]
        deadline, workers = time.monotonic() + 60, []
        while time.monotonic() < deadline and len(workers) < 2:
            workers = [
                env
                for env in map(_environ, filter(str.isdigit, os.listdir("/proc")))
                if env.get("RELAY_TEST_TAG") == tag and "RELAY_BUNDLE" in env
            ]
            time.sleep(0.2)
        assert len(workers) == 2, "the job's two workers did not start"
        for env in workers:
            assert env["RELAY_USER_PATH"] == str(tmp_path)
            assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)
            assert env["RELAY_SYS_PATH"].split(os.pathsep)[0] == str(tmp_path)
    finally:
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    assert p.returncode == 143, err


def _environ(pid: str) -> dict:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().decode(errors="replace").split("\0")
    except OSError:
        return {}
    return dict(item.partition("=")[::2] for item in items if "=" in item)


def test_user_code_given_as_a_file_loads_from_that_file_even_under_one_of_our_package_names(tmp_path):
    """``path/to/file.py:func`` is loaded from the file (relative to the working directory), so
    a user's own ``reward/`` package works that way; as a module path, ``reward.mine.f`` names
    the clash with this project's ``reward`` package and the file form to use instead."""
    (tmp_path / "reward").mkdir()
    (tmp_path / "reward" / "mine.py").write_text(
        "import os\n"
        "open(os.path.join(os.path.dirname(os.path.dirname(__file__)), 'loaded-by'), 'a').write('x')\n"
        "def score(args, sample):\n    return 1.0\n")
    p = relay(tmp_path, "plan", "--config", "tiny-cpu-split", "--custom-rm-path", "reward/mine.py:score")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "loaded-by").read_text() == "x"  # checked by loading it, from the file
    p = relay(tmp_path, "plan", "--config", "tiny-cpu-split", "--custom-rm-path", "reward.mine.score")
    assert p.returncode == 2
    assert "'reward' is also this project's own package (reward/), which shadows a package of yours" in p.stderr
    assert "--custom-rm-path path/to/reward/mine.py:score" in p.stderr, p.stderr
    for path, why in (("reward/mine.py:nope", "has no function 'nope'"), ("nofile.py:f", "no file "),
                      ("reward/mine.py", "a file is given as 'path/to/file.py:function'")):
        p = relay(tmp_path, "plan", "--config", "tiny-cpu-split", "--custom-rm-path", path)
        assert p.returncode == 2 and why in p.stderr, (path, p.stderr)


def test_a_file_hook_and_reward_run_in_a_job(tmp_path):
    """The same file forms reach the job's reward: the loaded function scores (load_callable
    gives the file's function; a second load reuses the module)."""
    from reward.rewards import load_callable

    (tmp_path / "hooks.py").write_text("CALLS = []\ndef f(args, sample):\n    CALLS.append(1)\n    return 0.5\n")
    fn = load_callable(f"{tmp_path / 'hooks.py'}:f", "--custom-rm-path")
    assert fn(None, {}) == 0.5 and load_callable(f"{tmp_path / 'hooks.py'}:f", "--custom-rm-path") is fn


@pytest.mark.parametrize(
    "flag,path,message",
    [
        (
            "--custom-reward-post-process-path",
            "examples.nope.f",
            "cannot import module 'examples.nope': No module named 'examples.nope'",
        ),
        ("--custom-rm-path", "nopkg.reward", "cannot import module 'nopkg': No module named 'nopkg'"),
        (
            "--custom-rm-path",
            "examples.cwd_hook.nope",
            r"module 'examples\.cwd_hook' \(.*cwd_hook\.py\) has no function 'nope'",
        ),
        (
            "--custom-rm-path",
            "examples.broken.reward",
            "importing module 'examples.broken' raised RuntimeError: the module itself is broken",
        ),
        ("--custom-rm-path", "noreward", r"must look like 'package\.module\.function'"),
    ],
)
@pytest.mark.parametrize("command", ["train", "plan"])
def test_a_bad_module_path_fails_before_anything_starts(tmp_path, command, flag, path, message):
    write_user_package(tmp_path)
    p = relay(tmp_path, command, "--config", "tiny-cpu-defer", flag, path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert re.search(f"relay {command}: {flag} {re.escape(path)}: {message}", p.stderr), p.stderr
    if "cannot import" in message:  # the search path, the working directory first
        assert f"searched (in order): {tmp_path}, " in p.stderr, p.stderr
        assert "Run relay from the directory that contains the module's top-level package" in p.stderr
    assert p.stdout == ""  # nothing placed: the controller prints the plan before starting agents


def test_torchrun_entry_checks_module_paths_too(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "--config",
            "tiny-cpu-defer",
            "--custom-reward-post-process-path",
            "examples.nope.f",
        ],
        cwd=tmp_path,
        env={**user_env(), "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        p.returncode == 2
        and "python -m launcher: --custom-reward-post-process-path examples.nope.f: cannot import" in p.stderr
    ), p.stderr
    assert p.stdout == ""


def test_sbatch_checks_module_paths_before_writing_a_script(tmp_path):
    p = relay(
        tmp_path,
        "sbatch",
        "--config",
        "tiny-cpu-split",
        "--nodes",
        "1",
        "-o",
        "job.sbatch",
        "--custom-rm-path",
        "nopkg.reward",
    )
    assert (
        p.returncode == 2 and "relay sbatch: --custom-rm-path nopkg.reward: cannot import module 'nopkg'" in p.stderr
    ), p.stderr
    assert not (tmp_path / "job.sbatch").exists()


# ---------------------------------------------------------------- what a job needs, checked up front

NO_JUDGE = [
    "--device",
    "cpu",
    "--gpus-per-node",
    "2",
    "--resource",
    '{"actor": [1, 2], "rollout": [1, 2]}',
    "--colocate",
]


def test_dapo_genrm_without_a_judge_is_rejected_by_relay_plan(tmp_path):
    p = relay(tmp_path, "plan", *NO_JUDGE, "--rm-type", "dapo-genrm")
    assert p.returncode == 2, p.stdout
    assert (
        "relay plan: --rm-type dapo-genrm scores every sample with a judge, and this config has none: add a genrm model"
        in p.stderr
    )
    assert "--genrm-model-path" in p.stderr and "--genrm-instances" in p.stderr


def test_dapo_genrm_with_several_judge_instances_is_rejected_by_relay_plan(tmp_path):
    instances = '{"quality": {"model_path": "a", "num_gpus": 1}, "safety": {"model_path": "b", "num_gpus": 1}}'
    p = relay(tmp_path, "plan", "--config", "tiny-cpu-split", "--genrm-instances", instances)
    assert p.returncode == 2, p.stdout
    assert "--rm-type dapo-genrm asks one judge without a route_key, and this config has 2 judge instances " \
        "(quality, safety): it cannot pick one" in p.stderr


def test_unreadable_self_check_pairs_are_rejected_by_relay_plan_naming_the_line(tmp_path):
    p = relay(tmp_path, "plan", "--config", "tiny-cpu-split", "--genrm-self-check-data", "nosuch.jsonl")
    assert p.returncode == 2
    assert "relay plan: --genrm-self-check-data nosuch.jsonl: No such file or directory" in p.stderr
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"label": "1", "response": "Answer: 1", "expected": 1}\n{"label": "1", "response": "2"}\n')
    p = relay(tmp_path, "plan", "--config", "tiny-cpu-split", "--genrm-self-check-data", str(bad))
    assert p.returncode == 2, p.stdout
    assert f"--genrm-self-check-data {bad}:2: a row needs label, response and expected" in p.stderr


@pytest.mark.unit
def test_check_job_needs_a_judge_for_dapo_genrm_and_a_reward_to_train():
    no_judge = load_config(
        None, {"resource": {"actor": [1, 2], "rollout": [1, 2]}, "colocate": True, "rm_type": "dapo-genrm"}
    )
    with pytest.raises(ConfigError, match="add a genrm model"):
        check_job(no_judge)
    check_job(no_judge, sft=True)  # relay sft never calls a reward
    judged = load_config(
        None,
        {
            "resource": {"actor": [1, 2], "rollout": [1, 1], "genrm": [1, 1]},
            "colocate": True,
            "rm_type": "dapo-genrm",
            "genrm_model_path": "/m",
        },
    )
    check_job(judged)
    custom = load_config(
        None,
        {
            "resource": {"actor": [1, 2], "rollout": [1, 2]},
            "colocate": True,
            "rm_type": "dapo-genrm",
            "custom_rm_path": "tests.reward.test_rewards.sync_reward",
        },
    )
    check_job(custom)  # the custom reward is what runs
    with pytest.raises(ConfigError, match="training needs a reward: set --rm-type"):
        check_job(
            load_config(
                None, {"resource": {"actor": [1, 2], "rollout": [1, 2]}, "colocate": True, "prompt_data": "p.jsonl"}
            )
        )


@pytest.mark.unit
def test_every_module_path_flag_is_checked():
    assert set(user_code_flags()) == {"custom_rm_path", "custom_reward_post_process_path",
                                      "custom_generate_function_path"}
    for name in user_code_flags():
        c = load_config(
            None,
            {"resource": {"actor": [1, 2], "rollout": [1, 2]}, "colocate": True, "rm_type": "dummy", name: "nopkg.fn"},
        )
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} nopkg.fn: cannot import module 'nopkg'"):
            check_job(c)


# ---------------------------------------------------------------- help lists every config flag


@pytest.mark.parametrize("command", ["plan", "train", "sft", "judge", "sbatch", "python -m launcher"])
def test_help_lists_the_config_flags_of_its_topics_with_their_help_and_default(tmp_path, command):
    """Grouped by topic (JobConfig's sections); relay sft and relay judge show only their topics."""
    from launcher.cli import COMMAND_TOPICS
    from launcher.config.schema import TOPICS

    if command == "python -m launcher":  # the torchrun entry
        p = subprocess.run(
            [sys.executable, "-m", "launcher", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
    else:
        p = relay(tmp_path, command, "--help")
    assert p.returncode == 0, p.stderr
    epilog = p.stdout.split("config flags (any YAML key", 1)[1]
    entries: dict[str, str] = {}  # "--flag METAVAR" lines, then their indented help
    headings = []
    for line in epilog.splitlines()[2:]:
        m = re.match(r"^  (--[a-z0-9-]+) \S+$", line)
        if m:
            flag = m.group(1)
            entries[flag] = line.strip()
        elif line.endswith(":") and not line.startswith(" "):
            headings.append(line[:-1])
        elif line.strip():
            entries[flag] += " " + line.strip()
    topics = COMMAND_TOPICS.get(command) or tuple(TOPICS)
    assert headings == list(topics)
    assert list(entries) == ["--" + name.replace("_", "-") for topic in topics for name in TOPICS[topic]]
    for flag, entry in entries.items():
        f = FIELDS[flag[2:].replace("-", "_")]
        assert " ".join(f.metadata["help"].split()) in entry and "[default: " in entry, entry
    text = " ".join(epilog.split())
    if command == "judge":
        assert "--genrm-model-path" in text and "--lr " not in text and "--num-rollout" not in text
        return
    if command == "sft":
        assert "--lr FLOAT" in text and "--genrm-model-path" not in text
        return
    assert "--num-rollout INT training steps (rollout + train) to run (>= 0) [default: 1]" in text
    assert "--resource JSON JSON {role: [num_groups, gpus_per_group]}" in text
    assert "--rm-type TEXT reward type (one of: dapo, dapo-genrm, dummy, math-verify) [default: unset]" in text
