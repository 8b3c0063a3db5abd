"""Multi-process runs: two JAX processes with 2 simulated CPU devices each, joined over gloo
(``specjax.distributed.launch``), one mesh of 4 devices over both.

- Decoding: on ``data=2,model=2`` (rows split across the processes) and ``model=4`` (every
  weight split across them), each method's greedy tokens equal the one-process run's, and
  every process gets the same whole output (tokens, lengths, statistics); the decode program
  has no host transfer (nothing leaves the devices inside the loop). By default ``ar``,
  ``sd-ngram:4`` and a random ``eagle2`` head on ``data=2,model=2`` (and the n-gram
  drafter on ``model=4`` through the command line below); every registered method's tiny
  specs on both meshes is ``extended``.
- The command line: ``python -m specjax.distributed -n 2 -- specjax generate ... --mesh
  model=4`` prints the tokens one process decodes; a process that dies ends the other with
  one line naming it, within ``--distributed-timeout``; flags that cannot describe a run, a
  mesh larger than the run's devices and disagreeing process counts are refused before any
  weight is read.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import specjax
import toys
from specjax import distributed
from toys import BUDGETS, PROMPTS

HERE = Path(__file__).parent
PY = sys.executable
# model=4 by default: test_cli_two_processes_print_what_one_decodes (sd-ngram:4)
DEFAULT_PLAN = {"data=2,model=2": ["ar", "sd-ngram:4", "eagle2:3,2,5"]}
# every method that drafts for the Llama toy (mtp, Gemma 4's: one process, tests/test_sharding.py)
FULL_PLAN = {"data=2,model=2": toys.conformance_specs("Llama"),
             "model=4": toys.conformance_specs("Llama")}


def _results(plan: dict) -> list[dict]:
    """Each process's ``RESULT`` of ``tests/mp_decode.py`` over ``plan``."""
    runs = distributed.launch([PY, str(HERE / "mp_decode.py"), "{coordinator}",
                               "{num_processes}", "{process_id}", json.dumps(plan)],
                              2, devices=2, timeout=900, env=toys.toy_process_env(
                                  dict(__import__("os").environ)))
    out = []
    for r in runs:
        lines = [ln for ln in r.output.splitlines() if ln.startswith("RESULT ")]
        assert r.returncode == 0 and lines, f"process {r.process_id}:\n{r.output[-3000:]}"
        out.append(json.loads(lines[-1][len("RESULT "):]))
    return out


def _ar_one_process() -> list[list[int]]:
    """Greedy ``ar`` in this process, on one device: every method's tokens
    (tests/test_conformance.py shows each method's equal ``ar``'s on one device)."""
    model, params = toys.llama(seed=1)
    return specjax.generate(model, params, PROMPTS, max_new_tokens=BUDGETS).to_lists()


def _check(plan: dict) -> None:
    results = _results(plan)
    assert [r["process"] for r in results] == [0, 1]
    assert all(r["devices"] == 4 and r["local"] == 2 for r in results)
    want = _ar_one_process()
    for mesh, specs in plan.items():
        for spec in specs:
            got = [r[f"{mesh}|{spec}"] for r in results]
            assert got[0] == got[1], (mesh, spec)  # tokens, lengths, statistics: all of it
            assert got[0]["tokens"] == want, (mesh, spec)
            assert got[0]["lengths"] == [len(t) for t in want]
            assert got[0]["host_transfers"] == [0, 0], (mesh, spec)
            if spec != "ar":
                assert sum(got[0]["accepted"][1:]) > 0, f"{spec}: nothing accepted: vacuous"


def test_two_processes_decode_as_one():
    _check(DEFAULT_PLAN)


@pytest.mark.extended  # every registered method on both meshes: about 22 compiles a process
def test_two_processes_decode_every_method_as_one():
    _check(FULL_PLAN)


# ----------------------------------------------------------------------------- the CLI

@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("toy-hf")
    toys.loaded_llama(path, seed=0, layers=2)
    return path


def _specjax(*args) -> list[str]:
    return [PY, "-m", "specjax.cli", *args]


def test_cli_two_processes_print_what_one_decodes(toy_dir, tmp_path):
    args = ["generate", "--model", str(toy_dir), "--prompt-ids", "5,6,7,8,9",
            "--max-new-tokens", "12", "--method", "sd-ngram:4", "--json"]
    r = subprocess.run([PY, "-m", "specjax.distributed", "-n", "2", "--devices", "2",
                        "--log-dir", str(tmp_path / "launch"), "--timeout", "300", "--",
                        *_specjax(*args, "--mesh", "model=4", "--log-dir", str(tmp_path / "w"))],
                       capture_output=True, text=True, timeout=400,
                       env=toys.toy_process_env(dict(__import__("os").environ)))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("{")))
    from specjax.models import load

    lm = load(str(toy_dir), tokenizer=False)
    want = specjax.generate(lm.model, lm.params, [[5, 6, 7, 8, 9]], max_new_tokens=12)
    assert got["token_ids"] == want.to_lists()[0]
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["process-0.log",
                                                                   "process-1.log"]
    assert '"token_ids"' not in (tmp_path / "w" / "process-0.log").read_text()  # stdout
    assert '"token_ids"' in (tmp_path / "w" / "process-1.log").read_text()  # its own log


_DIES = """
import os, sys, time
from specjax import distributed
distributed.initialize(distributed.Settings(sys.argv[1], 2, 1, int(sys.argv[2])))
time.sleep(2)
os._exit(7)
"""


def test_a_dead_process_ends_the_other_with_one_line(toy_dir, tmp_path):
    timeout = 5
    coordinator = f"127.0.0.1:{distributed.free_port()}"
    env = {**__import__("os").environ,
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    start = time.monotonic()
    p0 = subprocess.Popen(_specjax(
        "generate", "--model", str(toy_dir), "--prompt-ids", "5,6,7", "--max-new-tokens", "8",
        "--mesh", "model=4", "--coordinator", coordinator, "--num-processes", "2",
        "--process-id", "0", "--distributed-timeout", str(timeout), "--log-dir", str(tmp_path)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    p1 = subprocess.Popen([PY, "-c", _DIES, coordinator, str(timeout)], env=env)
    out, err = p0.communicate(timeout=120)
    p1.wait(timeout=30)
    took = time.monotonic() - start
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert p0.returncode != 0 and p1.returncode == 7
    assert len(lines) == 1, err
    assert lines[0].startswith("specjax: process 0: stopped: process 1 stopped sending "
                               "heartbeats"), lines
    assert took < timeout + 60, took  # start-up, the toy's load and the timeout


def test_impossible_runs_are_refused_before_loading(tmp_path):
    """Refused in one line: an incomplete set of flags (before any process starts), and in
    a joined run a mesh larger than both processes' devices (before any weight is read:
    the model path does not exist)."""
    r = subprocess.run(_specjax("generate", "--model", "nowhere", "--prompt-ids", "5",
                                "--coordinator", "127.0.0.1:1", "--num-processes", "2"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "needs all three of --coordinator" in r.stderr
    runs = distributed.launch(_specjax("generate", "--model", str(tmp_path / "nowhere"),
                                       "--prompt-ids", "5", "--mesh", "data=1,model=8",
                                       "--coordinator", "{coordinator}",
                                       "--num-processes", "{num_processes}",
                                       "--process-id", "{process_id}",
                                       "--log-dir", str(tmp_path / "logs")), 2, timeout=120)
    for r in runs:
        assert r.returncode == 2, r.output
        assert f"specjax: process {r.process_id}: error: --mesh data=1,model=8: the mesh " \
               "needs 8 devices, but the 2 processes of this run have 4" in r.output, r.output


def test_processes_started_differently_are_refused(tmp_path):
    """Every process of a run must run the same command: a process started with other
    arguments, or with another process count, stops the run in one line before loading."""
    cmd = _specjax("generate", "--model", str(tmp_path / "nowhere"), "--prompt-ids", "5",
                   "--max-new-tokens", "{process_id}1", "--coordinator", "{coordinator}",
                   "--num-processes", "{num_processes}", "--process-id", "{process_id}",
                   "--log-dir", str(tmp_path / "logs"), "--distributed-timeout", "20")
    runs = distributed.launch(cmd, 2, timeout=120)
    assert all(r.returncode == 1 for r in runs), [r.output for r in runs]
    assert "process 1 was started with other arguments: max_new_tokens=11 there, 1 here" \
        in runs[0].output, runs[0].output


@pytest.mark.extended  # the device check's --small run as two processes: about 2 min
def test_device_check_runs_as_two_processes(tmp_path):
    """``scripts/device_check.py --small --mesh model=4`` as 2 processes: every method's
    greedy tokens equal ``ar``'s on the mesh, no host transfer in any loop, and process 0
    alone writes the JSON."""
    runs = distributed.launch([PY, str(HERE.parent / "scripts" / "device_check.py"), "--small",
                               "--shapes", "tiny-llama", "--mesh", "model=4", "--no-hf",
                               "--out", str(tmp_path), "--coordinator", "{coordinator}",
                               "--num-processes", "{num_processes}",
                               "--process-id", "{process_id}"], 2, timeout=900)
    assert all(r.returncode == 0 for r in runs), [r.output[-2000:] for r in runs]
    res = json.loads((tmp_path / "device_check_cpu.json").read_text())
    assert res["processes"] == 2 and res["mesh"] == "model=4" and res["complete"]
    ms = res["shapes"]["tiny-llama"]["methods"]
    assert len(ms) > 5 and all(r["equal_to_ar"] for r in ms.values()), ms
    assert all(r["host_transfers_in_loop"] == 0 for r in ms.values())
