"""Every shell command of README.md and docs/*.md runs here, as written, through bash.

Where: a fresh copy of the repository (its tracked and new files) in a temporary
directory, with a temporary HOME; ``relay`` is the installed console script (the venv's bin
directory first on PATH, as after ``source .venv/bin/activate``). The commands of one fenced
block run in order in one test (a block is what a user types in sequence: ``relay plot
runs/split`` needs the ``relay train`` before it); the demo's build (``.cache/demo``), which
the README's sub-mode commands use, is made once by the documented ``bash scripts/demo.sh``.

Small: the docs name the variables that shorten their commands, and this harness sets them
(``STEPS=2``: GRPO steps per README sub-mode run; ``PORT``: the judge's port, a free one).

Each command must exit 0 and print the line fragment EXPECTED gives for its exact text: a
command changed in a doc fails here until its entry is updated, and a new one fails until
it has an entry. Only commands marked ``# needs a GPU ...`` are skipped (with that reason).
``bash scripts/test.sh`` is this test suite: CI runs it (``.ci/run``), which is asserted.
``relay judge`` serves until stopped: it is started, the block's ``curl`` commands run
against it, then it is stopped with SIGINT and must exit 0.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid

import pytest

from tests.helpers import tagged_pids

from .doc_commands import ROOT, DocCommand, commands, count_command_lines, doc_files

pytestmark = pytest.mark.e2e

#: The documented commands -> a fragment of a line each must print (exact command text).
CI = "(run by CI: .ci/run)"
EXPECTED: dict[str, str] = {
    # README.md: the two commands
    "bash scripts/demo.sh": "GRPO with a GenRM judge works end to end",
    "bash scripts/test.sh": CI,
    # README.md: every sub-mode, with the demo's tiny models
    'relay train --config tiny-cpu-split  "${T[@]}" --run-dir runs/split   # colocate Split: rollout | judge on disjoint bundles': "(colocate-split)",
    'relay train --config tiny-cpu-shared "${T[@]}" --run-dir runs/shared  # colocate Co-resident: both on every bundle, awake together': "(colocate-shared)",
    'relay train --config tiny-cpu-defer  "${T[@]}" --run-dir runs/defer   # colocate Defer-swap: rollout and judge take turns': "(colocate-defer)",
    'relay train --config tiny-cpu-async  "${T[@]}" --run-dir runs/async   # fully-async: dedicated pools, bounded staleness': "(fully-async)",
    "relay plot runs/split": "wrote runs/split/reward.png",
    # docs/judge.md
    "relay judge --config tiny-cpu-split --port ${PORT:-8000}   # builds the tiny judge on first use; serves until Ctrl-C": "judge ready: http://127.0.0.1:",
    'curl http://127.0.0.1:${PORT:-8000}/genrm/health            # {"status": "healthy", "service": "genrm"}': '{"status": "healthy", "service": "genrm"}',
    "curl -X POST http://127.0.0.1:${PORT:-8000}/genrm/generate -H 'Content-Type: application/json' \\\n"
    '     -d \'{"messages": [{"role": "user", "content": "Is 2+2=4? Reply 1 or 0."}]}\'': '{"response": ',
    "stat -c '%a %n' ~/.cache/relay/judge-${PORT:-8000}.secret   # the judge's secret file: 600 (readable by you only)": "600 ",
    "curl http://127.0.0.1:${PORT:-8000}/genrm/metrics           # "
    '{"service": "genrm", "model_path": ..., "num_gpus": ..., "num_engines": ..., counters}': '{"service": "genrm", ',
    "curl http://127.0.0.1:${PORT:-8000}/metrics                 # the same counters as Prometheus text": (
        'genrm_requests_total{route_key="__default__"} 1'
    ),
    # docs/judge.md: evaluating a judge
    'relay judge eval --config tiny-cpu-split --data examples/judge_pairs.jsonl --compare "--genrm-parse loose"':
        "relay judge eval: 8 pairs from examples/judge_pairs.jsonl",
    # docs/judge.md: elastic judges
    "relay judge --config tiny-cpu-split --port ${PORT:-8000}   # 2 engines; the split layout leaves 2 of its 4 bundles free":
        "judge ready: http://127.0.0.1:",
    "curl -X POST http://127.0.0.1:${PORT:-8000}/genrm/scale_out -H 'Content-Type: application/json' "
    "-d '{\"num_engines\": 1}'": '"action": "scale_out"',
    'curl http://127.0.0.1:${PORT:-8000}/genrm/scale_out/out-1   # {"status": "succeeded", "engines": [2], ...} once '
    "loaded": '"request_id": "out-1"',
    "curl -X POST http://127.0.0.1:${PORT:-8000}/genrm/scale_in -H 'Content-Type: application/json' "
    "-d '{\"num_engines\": 1}'": '"action": "scale_in"',
    "curl http://127.0.0.1:${PORT:-8000}/genrm/v1/models         # OpenAI-compatible: one model per judge instance": (
        '"data": [{"id": "__default__", "object": "model"'
    ),
    "curl -X POST http://127.0.0.1:${PORT:-8000}/genrm/v1/chat/completions -H 'Content-Type: application/json' \\\n"
    '     -d \'{"model": "__default__", "messages": [{"role": "user", "content": "Is 2+2=4?"}], "max_tokens": 4}\'': (
        '"object": "chat.completion"'
    ),
    # docs/launcher.md
    "relay train --config tiny-cpu-split": "shut down cleanly",
    "torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 \\\n"
    "    -m launcher --config qwen35-35b-a3b-16gpu-genrm-397b-split   # needs a GPU: 2 nodes x 8 GPUs; HEAD = the first node": "placed a probe actor on every bundle",
    "relay train --config tiny-cpu-split --network-interface lo": "shut down cleanly",
    "relay sbatch --config qwen35-35b-a3b-16gpu-genrm-397b-split --nodes 2 --partition gpu \\\n"
    "    --time 24:00:00 --network-interface ib0 -o job.sbatch": "wrote job.sbatch",
    # docs/failures.md
    "relay train --config tiny-cpu-split --use-fault-tolerance --max-global-restart 2": "shut down cleanly",
    "torchrun --nnodes 2 --nproc-per-node 1 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 \\\n"
    "    -m launcher --config qwen35-35b-a3b-16gpu-genrm-397b-split --use-fault-tolerance --save-interval 10   # needs a GPU: 2 nodes x 8 GPUs; HEAD = the first node": "placed a probe actor on every bundle",
}
#: Commands that serve until stopped -> the line they print when stopped cleanly.
SERVERS = {"relay judge --": "judge stopped"}  # `relay judge` serves until stopped (`relay judge eval` ends)
#: What the variables the docs name are set to here.
SMALL = {"STEPS": "2"}
DEMO = "bash scripts/demo.sh"
TIMEOUT = {DEMO: 1800, "relay train": 420}


def all_commands() -> list[DocCommand]:
    return [c for doc in doc_files() for c in commands(doc)]


def cases() -> list:
    """One test per fenced block (its commands in order), except commands that run alone:
    those marked as needing a GPU, the one CI runs and the demo (a shared fixture)."""
    out, blocks = [], {}
    for c in all_commands():
        if c.gpu or EXPECTED.get(c.text) == CI:
            out.append(pytest.param([c], id=c.where))
        elif c.text == DEMO:
            out.append(pytest.param([c], id=c.where, marks=pytest.mark.timeout(60 + _timeout(c))))
        else:
            blocks.setdefault((c.doc, c.block), []).append(c)
    for group in blocks.values():
        budget = 60 + sum(_timeout(c) for c in group) + (TIMEOUT[DEMO] if _needs_demo(group) else 0)
        out.append(pytest.param(group, id=group[0].where, marks=pytest.mark.timeout(budget)))
    return out


def _needs_demo(block: list[DocCommand]) -> bool:
    """Whether the block uses the demo's build (.cache/demo, made by the demo command)."""
    return any(".cache/demo" in s for c in block for s in (*c.setup, c.text))


def _timeout(c: DocCommand) -> int:
    return next((t for prefix, t in TIMEOUT.items() if c.text.startswith(prefix)), 120)


# ---------------------------------------------------------------- every command is covered


def test_every_documented_command_has_an_entry_and_nothing_is_left_out():
    found = all_commands()
    assert len(found) == sum(count_command_lines(doc) for doc in doc_files())  # two counts agree
    texts = [c.text for c in found]
    missing = [c.where + ": " + c.text for c in found if c.text not in EXPECTED]
    assert not missing, (
        "documented commands without an EXPECTED entry (add one: the fragment of output it must print):\n"
        + "\n".join(missing)
    )
    stale = [t for t in EXPECTED if t not in texts]
    assert not stale, "EXPECTED entries no doc has any more (the doc line changed?):\n" + "\n".join(stale)
    covered = [c for p in cases() for c in p.values[0]]
    assert sorted(c.where for c in covered) == sorted(c.where for c in found)


def test_ci_runs_the_documented_test_command():
    """``bash scripts/test.sh`` would run this suite inside itself; CI runs it instead:
    .ci/run invokes exactly that command, adding only pytest's reporting options."""
    documented = shlex.split(next(c.text for c in all_commands() if EXPECTED[c.text] == CI))
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        calls = [shlex.split(line) for line in f if line.strip().startswith(documented[0] + " ")]
    assert calls and calls[0][: len(documented)] == documented, calls
    extra = calls[0][len(documented) :]
    assert all(a.startswith("-") and a.split("=")[0] in ("-q", "-ra", "--durations") for a in extra), (
        extra
    )  # no test selection


# ---------------------------------------------------------------- running them


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    """A fresh copy of the repository, the venv reachable as ./.venv (scripts/setup.sh
    finds it set up: nothing is installed), a temporary HOME and a stub ``sbatch``."""
    base = tmp_path_factory.mktemp("docs")
    repo = base / "repo"
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, text=True
    )
    if listed.returncode == 0 and listed.stdout:
        for rel in filter(None, listed.stdout.split("\0")):
            if os.path.isfile(os.path.join(ROOT, rel)):
                os.makedirs(os.path.join(repo, os.path.dirname(rel)), exist_ok=True)
                shutil.copy2(os.path.join(ROOT, rel), os.path.join(repo, rel))
    else:
        shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".git", ".venv", ".cache", "runs", "__pycache__"))
    venv = sys.prefix
    stamp = os.path.join(venv, ".relay-installed")
    assert sys.prefix != sys.base_prefix and os.path.exists(stamp), (
        f"the docs tests need the venv made by scripts/setup.sh (running {sys.executable}: no {stamp})"
    )
    os.symlink(venv, repo / ".venv")
    # setup.sh reinstalls when pyproject.toml is newer than its stamp: this copy is not newer
    # (in nanoseconds: a float of seconds can round above the stamp, and setup.sh would then reinstall the
    # package from this temporary copy into the shared venv)
    t = min(os.stat(repo / "pyproject.toml").st_mtime_ns, os.stat(stamp).st_mtime_ns)
    os.utime(repo / "pyproject.toml", ns=(t, t))
    home = base / "home"
    home.mkdir()
    stub = base / "stub-bin"
    stub.mkdir()
    # slurm is not installed here: a stand-in for `sbatch` that checks what it is given
    # (a bash script with #SBATCH lines) and answers as slurm does.
    (stub / "sbatch").write_text(
        '#!/bin/bash\nset -e\n[ -f "$1" ] || { echo "sbatch: error: Unable to open file $1" >&2; exit 1; }\n'
        'grep -q "^#SBATCH " "$1" || { echo "sbatch: error: no #SBATCH lines in $1" >&2; exit 1; }\n'
        'bash -n "$1"\necho "Submitted batch job 4242"\n'
    )
    (stub / "sbatch").chmod(0o755)
    return {
        "repo": str(repo),
        "home": str(home),
        "path": os.pathsep.join([os.path.dirname(sys.executable), str(stub), os.environ["PATH"]]),
    }


def _env(workdir: dict, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RELAY_CACHE", "RELAY_USER_PATH", "RELAY_GENRM"))}
    env.update(HOME=workdir["home"], PATH=workdir["path"], PYTHONUNBUFFERED="1", **SMALL, **extra)
    return env


def _run(c: DocCommand, workdir: dict, env: dict) -> str:
    """Run one command to its end; return its output (stdout and stderr)."""
    p = subprocess.Popen(
        ["bash", "-c", c.script],
        cwd=workdir["repo"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=_timeout(c))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        raise AssertionError(f"{c.where}: timed out after {_timeout(c)} s:\n$ {c.text}\n{out[-4000:]}") from None
    _check(c, p.returncode, out)
    return out


def _check(c: DocCommand, code: int, out: str) -> None:
    want = EXPECTED[c.text]
    assert code == 0, f"{c.where}: exit {code}\n$ {c.text}\n{out[-4000:]}"
    assert want in out, f"{c.where}: no line with {want!r} in its output\n$ {c.text}\n{out[-4000:]}"


@pytest.fixture(scope="session")
def demo(workdir):
    """``bash scripts/demo.sh`` once (it builds .cache/demo, which the README's sub-mode
    commands use); its own tag: nothing it started may outlive it."""
    c = next(c for c in all_commands() if c.text == DEMO)
    tag = uuid.uuid4().hex
    out = _run(c, workdir, _env(workdir, RELAY_TEST_TAG=tag))
    left = tagged_pids(tag)
    assert not left, f"bash scripts/demo.sh left processes behind: {left}"
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(c: DocCommand, workdir: dict, env: dict) -> tuple[subprocess.Popen, list[str], threading.Thread]:
    """Start a serving command; return once it printed its EXPECTED line (a thread keeps
    collecting its output)."""
    p = subprocess.Popen(
        ["bash", "-c", c.script],
        cwd=workdir["repo"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in p.stdout:
            lines.append(line)
            if EXPECTED[c.text] in line:
                ready.set()
        ready.set()  # ended

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ready.wait(_timeout(c))
    if not any(EXPECTED[c.text] in line for line in lines):
        _kill(p, reader)
        raise AssertionError(f"{c.where}: never printed {EXPECTED[c.text]!r}\n$ {c.text}\n{''.join(lines)[-4000:]}")
    return p, lines, reader


def _kill(p: subprocess.Popen, reader: threading.Thread) -> None:
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    reader.join(10)


def _stop(c: DocCommand, p: subprocess.Popen, lines: list[str], reader: threading.Thread) -> None:
    """Ctrl-C, as a user stops it (SIGINT to its process group): exit 0, saying so."""
    os.killpg(p.pid, signal.SIGINT)
    try:
        p.wait(60)
    except subprocess.TimeoutExpired:
        _kill(p, reader)
    reader.join(10)
    out = "".join(lines)
    stopped = next(v for k, v in SERVERS.items() if c.text.startswith(k))
    assert p.returncode == 0 and stopped in out, (
        f"{c.where}: did not stop cleanly on Ctrl-C (exit {p.returncode})\n{out[-4000:]}"
    )


@pytest.mark.parametrize("block", cases())
def test_documented_commands(block: list[DocCommand], workdir, request):
    first = block[0]
    unlisted = [c.where for c in block if c.text not in EXPECTED]
    assert not unlisted, f"no EXPECTED entry for the commands at {unlisted} (their doc lines changed?)"
    if first.gpu:
        pytest.skip(f"{first.where}: {first.gpu}")
    if EXPECTED[first.text] == CI:
        return test_ci_runs_the_documented_test_command()
    if first.text == DEMO:
        out = request.getfixturevalue("demo")
        _check(first, 0, out)
        return
    if _needs_demo(block):
        request.getfixturevalue("demo")  # the demo's models
    env = _env(workdir, PORT=str(_free_port()))
    server = None
    try:
        for c in block:
            if any(c.text.startswith(k) for k in SERVERS):
                server = (c, *_serve(c, workdir, env))
            else:
                _run(c, workdir, env)
    finally:
        if server is not None:
            _stop(*server)
