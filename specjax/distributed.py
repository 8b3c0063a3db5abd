"""Multi-process JAX (a TPU pod slice, a GPU cluster, or local CPU processes): starting the
runtime, which process speaks, and a launcher for N local processes.

JAX runs one process per host there (its multi-controller runtime): every process calls
:func:`initialize` first, builds the same mesh over ``jax.devices()`` (all processes'
devices, ``specjax.sharding.make_mesh``) and runs the same program on the same inputs.
``specjax.sharding.place`` and ``gather`` move host values onto such a mesh and results back.

:func:`initialize` with explicit settings starts a run of ``num_processes`` processes whose
process 0 serves at ``coordinator``; with none, on a TPU pod slice, under SLURM or Open MPI,
JAX detects the cluster (``jax.distributed.initialize()``). On CPU it selects the gloo
collectives, so local processes can run one mesh (``launch``; ``python -m
specjax.distributed``).

A process that dies or cannot be reached ends the others: JAX's coordination service
notices the missing heartbeats within ``timeout`` seconds and stops every process with an
error (each process prints one ``specjax: process I ...`` line where it can tell).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import jax

#: environment variables that name a cluster JAX detects by itself
CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES",
               "CLOUD_TPU_TASK_ID", "MEGASCALE_COORDINATOR_ADDRESS")


@dataclasses.dataclass(frozen=True)
class Settings:
    """How this process joins a multi-process run. All of ``coordinator``,
    ``num_processes`` and ``process_id`` unset: join the detected cluster, if any;
    ``timeout``: seconds to wait for the others at start-up, and for a silent process
    before the run is ended (JAX's heartbeat)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    timeout: int = 300

    def check(self) -> "Settings":
        """``ValueError`` (one line) for settings that cannot describe a run."""
        given = [x is not None for x in (self.coordinator, self.num_processes, self.process_id)]
        if any(given) and not all(given):
            raise ValueError("a multi-process run needs all three of --coordinator HOST:PORT, "
                             "--num-processes N and --process-id I (or none, to let JAX "
                             "detect a TPU pod, SLURM or Open MPI)")
        if self.coordinator is not None:
            host, sep, port = self.coordinator.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"--coordinator {self.coordinator!r}: expected HOST:PORT")
            if self.num_processes < 1:
                raise ValueError(f"--num-processes must be >= 1, got {self.num_processes}")
            if not 0 <= self.process_id < self.num_processes:
                raise ValueError(f"--process-id {self.process_id} is not in "
                                 f"[0, {self.num_processes})")
        if self.timeout < 1:
            raise ValueError(f"--distributed-timeout must be >= 1 s, got {self.timeout}")
        return self

    @property
    def explicit(self) -> bool:
        return self.coordinator is not None

    @property
    def detected(self) -> bool:
        """Whether this process runs in a cluster JAX can join by itself (a Cloud TPU VM
        of a pod slice, SLURM, Open MPI, Kubernetes: JAX's own cluster detection)."""
        try:
            from jax._src import clusters

            return any(c.is_env_present() for c in clusters.ClusterEnv._cluster_types)
        except Exception:  # noqa: BLE001 -- a JAX without that module: its usual variables
            return any(os.environ.get(k) for k in CLUSTER_ENV)


def initialize(settings: Settings = Settings(), detect: bool = True) -> bool:
    """Joins the multi-process run ``settings`` describe, before any other JAX call of this
    process; returns whether it did. Explicit settings of one process, or none outside a
    detected cluster (or with ``detect=False``), start nothing (a single-process run). On CPU, selects the gloo
    collectives first. Raises ``ValueError`` for settings that cannot describe a run and
    ``RuntimeError`` (one line, naming the coordinator) when the others do not all join
    within ``settings.timeout``."""
    s = settings.check()
    if s.explicit and s.num_processes == 1:
        return False
    if not s.explicit and not (detect and s.detected):
        return False
    if jax.distributed.is_initialized():
        return True
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kw = dict(initialization_timeout=s.timeout, heartbeat_timeout_seconds=s.timeout)
    try:
        if s.explicit:
            jax.distributed.initialize(s.coordinator, s.num_processes, s.process_id, **kw)
        else:
            jax.distributed.initialize(**kw)
    except Exception as e:  # the runtime raises XlaRuntimeError / its own types
        where = f"the coordinator {s.coordinator}" if s.explicit else "the detected cluster"
        raise RuntimeError(f"specjax: process {s.process_id if s.explicit else '?'} could not "
                           f"join {where} within {s.timeout} s: "
                           f"{str(e).splitlines()[0][:300]}") from None
    return True


_AGREED = 0


def agree(settings: Settings, values: dict) -> None:
    """``ValueError`` (one line) unless every process of the run was started with the same
    ``values`` (a command's arguments, its own process id and log paths left out) and the
    process count that ``settings`` names. Exchanged through the coordination service's
    key-value store before any weight is read; waits ``settings.timeout`` at most."""
    import json

    if jax.process_count() == 1:
        return
    if settings.explicit and settings.num_processes != jax.process_count():
        raise ValueError(f"--num-processes {settings.num_processes}, but process 0 started a "
                         f"run of {jax.process_count()} processes")
    from jax._src.distributed import global_state

    global _AGREED
    _AGREED += 1  # one key per call: a process may run several commands
    mine = json.dumps(values, sort_keys=True, default=str)
    client, me = global_state.client, jax.process_index()
    client.key_value_set(f"specjax/args/{_AGREED}/{me}", mine)
    for other in range(jax.process_count()):
        theirs = client.blocking_key_value_get(f"specjax/args/{_AGREED}/{other}",
                                               settings.timeout * 1000)
        if theirs != mine:
            a, b = json.loads(mine), json.loads(theirs)
            diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            raise ValueError(f"process {other} was started with other arguments: "
                             + ", ".join(f"{k}={b.get(k)!r} there, {a.get(k)!r} here"
                                         for k in diff[:3]))


def process_index() -> int:
    return jax.process_index()


def is_main() -> bool:
    """Whether this is process 0, the one that prints results and writes files."""
    return jax.process_index() == 0


def check_devices(need: int) -> None:
    """In a multi-process run, ``ValueError`` (one line) unless the run's devices, over
    every process, number at least ``need``; called before any weight is read."""
    have, n = jax.device_count(), jax.process_count()
    if n > 1 and need > have:  # one process: make_mesh's own message
        raise ValueError(f"the mesh needs {need} devices, but the {n} process"
                         f"{'es' if n > 1 else ''} of this run have {have} "
                         f"({jax.local_device_count()} here)")


# ----------------------------------------------------------------------------- supervision

#: set in the child a supervising ``specjax`` command runs (``supervise``)
WORKER_ENV = "SPECJAX_DISTRIBUTED_WORKER"
_RANK_ENV = ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "CLOUD_TPU_TASK_ID", "TPU_WORKER_ID")
_NOISE = re.compile(r"^(\s*$|[EFWI]\d{4} |\*\*\* |    @ |\[Gloo\]|RPC: |\d+$|The tasks have crashed)")


def rank_of(settings: Settings) -> str:
    """This process's index as the settings or the cluster's environment tell it."""
    if settings.explicit:
        return str(settings.process_id)
    return next((os.environ[k] for k in _RANK_ENV if os.environ.get(k)), socket.gethostname())


def supervise(argv: Sequence[str], settings: Settings, log_dir: str | Path) -> int:
    """Runs ``specjax ARGV`` as this host's process of a multi-process run, in a child
    process it watches, and returns its exit status. The child's output goes to
    ``log_dir/process-I.log``; process 0's standard output, and its messages without the
    runtime's own log lines, also reach the terminal. When the child fails, one line says
    which process stopped and why (``why``), whatever the runtime printed before aborting."""
    rank = rank_of(settings)
    log = Path(log_dir) / f"process-{rank}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    main = rank == "0"
    env = {**os.environ, WORKER_ENV: "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "w", buffering=1) as f:
        child = subprocess.Popen([sys.executable, "-m", "specjax.cli", *argv], env=env,
                                 stdout=None if main else f, stderr=subprocess.PIPE,
                                 text=True, errors="replace")
        try:
            for line in child.stderr:
                f.write(line)
                if main and not _NOISE.match(line) and not line.startswith("specjax: error:"):
                    sys.stderr.write(line)
            rc = child.wait()
        except BaseException:
            child.kill()
            child.wait()
            raise
    if rc == 0:
        return 0
    print(f"specjax: process {rank}: {why(log.read_text(errors='replace'), rc, settings)} "
          f"(log: {log})", file=sys.stderr)
    return rc if rc > 0 else 1


def why(text: str, returncode: int, settings: Settings) -> str:
    """The cause of a worker's exit, in a few words, from its log and exit status."""
    err = [ln for ln in text.splitlines() if ln.startswith("specjax: ")]
    if err:
        return err[-1].removeprefix("specjax: ")
    dead = re.search(r"tasks are unhealthy \(stopped sending heartbeats\):\s*\n([\d\s,]+)",
                     text)
    if dead:
        ids = ", ".join(dead.group(1).split())
        return (f"stopped: process {ids} stopped sending heartbeats for "
                f"{settings.timeout} s (it died or hangs; see its log)")
    if re.search(r"(?i)heartbeat|coordination service|Failed to send RPC|UNAVAILABLE", text):
        where = settings.coordinator or "the coordinator"
        return (f"stopped: lost the coordination service of process 0 at {where} "
                f"(it died or cannot be reached)")
    if returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


# ----------------------------------------------------------------------------- local launcher

@dataclasses.dataclass
class Result:
    """One launched process: its exit status and everything it printed."""

    process_id: int
    returncode: int
    output: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(command: Sequence[str], processes: int, *, devices: int = 2,
           timeout: float = 600.0, env: dict | None = None,
           log_dir: str | Path | None = None) -> list[Result]:
    """Runs ``command`` as ``processes`` local processes of one run, each with ``devices``
    simulated CPU devices, and returns their results in process order.

    In each argument, ``{coordinator}``, ``{num_processes}`` and ``{process_id}`` are
    replaced by the run's values (``127.0.0.1`` on a free port). Output goes to
    ``log_dir/process-I.log`` (a temporary file without ``log_dir``). When one process
    exits non-zero the others get ``timeout`` more seconds at most; past ``timeout`` in all,
    every process left is killed (its result: returncode -9)."""
    import tempfile

    port = free_port()
    values = dict(coordinator=f"127.0.0.1:{port}", num_processes=processes)
    base = dict(os.environ if env is None else env)
    flags = base.get("XLA_FLAGS", "")
    base["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    base.setdefault("JAX_PLATFORMS", "cpu")
    logs = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="specjax-mp-"))
    logs.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    for i in range(processes):
        argv = [_fill(a, {**values, "process_id": i}) for a in command]
        f = open(logs / f"process-{i}.log", "w+")
        files.append(f)
        procs.append(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=base,
                                      start_new_session=True))
    _wait(procs, timeout)
    out = []
    for i, (p, f) in enumerate(zip(procs, files)):
        f.seek(0)
        out.append(Result(i, p.returncode, f.read()))
        f.close()
    return out


def _fill(arg: str, values: dict) -> str:
    """``arg`` with each ``{name}`` of ``values`` replaced (other braces kept as they are)."""
    for k, v in values.items():
        arg = arg.replace("{" + k + "}", str(v))
    return arg


def _wait(procs: list[subprocess.Popen], timeout: float) -> None:
    """Waits for every process; kills the rest at ``timeout``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specjax.distributed -n N [--devices D] -- COMMAND ...``: COMMAND as N
    local processes (``launch``), each given ``--coordinator``, ``--num-processes`` and
    ``--process-id`` after its arguments; prints each process's log path and exit status,
    and process 0's output. Exits with the first non-zero status."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m specjax.distributed")
    p.add_argument("-n", "--processes", type=int, default=2)
    p.add_argument("--devices", type=int, default=2, help="simulated CPU devices per process")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--log-dir", default="specjax-logs")
    p.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    cmd = [c for c in a.command if c != "--"]
    if not cmd:
        p.error("give the command to run after --")
    cmd += ["--coordinator", "{coordinator}", "--num-processes", "{num_processes}",
            "--process-id", "{process_id}"]
    results = launch(cmd, a.processes, devices=a.devices, timeout=a.timeout,
                     log_dir=a.log_dir)
    sys.stdout.write(results[0].output)
    for r in results:
        print(f"[process {r.process_id}] exit {r.returncode}, log {a.log_dir}/process-"
              f"{r.process_id}.log", file=sys.stderr)
    return next((r.returncode for r in results if r.returncode), 0)


if __name__ == "__main__":
    sys.exit(main())
