"""The package as users install it: a wheel built from a clean tree, installed in a fresh
virtual environment, run from outside the checkout (issue 48)."""

from __future__ import annotations

import concurrent.futures
import glob
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh venv (under a temporary directory) with the wheel of a clean copy of the
    tracked tree installed, the dependencies seen from this environment (they are not what
    is tested; the package's own files are). Returns (venv, a working directory outside
    the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    tree = tmp / "tree"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src, dst = os.path.join(ROOT, rel), tree / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        elif os.path.isfile(src):
            shutil.copy2(src, dst)
    dist = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(tree)], check=True, timeout=300)
    wheel = glob.glob(str(dist / "*.whl"))
    assert len(wheel) == 1, wheel
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    vpy = str(venv / "bin" / "python")
    site = subprocess.run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    here_site = sysconfig.get_paths()["purelib"]
    # pip from this environment, run by the new interpreter: it installs there, scripts included
    # --ignore-installed: the editable install this environment holds is never touched
    subprocess.run([vpy, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", wheel[0]],
                   check=True,
                   env=dict(os.environ, PYTHONPATH=here_site), timeout=300)
    with open(os.path.join(site, "zz_dependencies.pth"), "w") as f:
        f.write(here_site + "\n")  # after the venv's own site-packages: the wheel's code comes first
    outside = tmp / "elsewhere"
    outside.mkdir()
    return venv, outside


def _run(venv, cwd, *args, timeout=120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_wheel_holds_the_code_configs_and_protocol_record_and_no_examples_package(installed):
    venv, outside = installed
    p = _run(venv, outside, str(venv / "bin" / "python"), "-c", "\n".join([
        "import importlib.util, os, launcher, engines.sglang.args as a",
        "from launcher.config import SHIPPED_CONFIGS",
        "print(launcher.__file__)",
        "print(len([f for f in os.listdir(SHIPPED_CONFIGS) if f.endswith('.yaml')]))",
        "print(a.protocol()['sglang_version'])",
        "print(importlib.util.find_spec('examples'))",
        "import reward.examples.post_process_genrm_swap, reward.examples.reward_dual_genrm_quality_safety",
    ]))
    assert p.returncode == 0, p.stderr[-3000:]
    where, configs, version, examples = p.stdout.split("\n")[:4]
    assert where.startswith(str(venv)) and not where.startswith(ROOT), where  # the installed copy, not the checkout
    assert int(configs) == len(glob.glob(os.path.join(ROOT, "torchrun_configs", "*.yaml"))) > 10
    assert version and examples == "None"


def test_relay_plans_every_shipped_config_and_shows_the_demo_help_from_outside_the_checkout(installed):
    venv, outside = installed
    names = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(ROOT, "torchrun_configs", "*.yaml")))
    def plan(name: str):
        sft = ["--sft"] if name.endswith("-sft") else []  # relay sft's placement
        return name, _run(venv, outside, "relay", "plan", "--config", name, *sft)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two at a time: each is mostly its imports
        plans = list(pool.map(plan, names))
    failed = {name: (p.stderr or p.stdout)[-800:] for name, p in plans
              if p.returncode != 0 or "layout:" not in p.stdout}
    assert len(plans) == len(names) and not failed, failed
    p = _run(venv, outside, "relay", "demo", "--help")
    assert p.returncode == 0 and "--arch" in p.stdout, p.stderr[-2000:]
