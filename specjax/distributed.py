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

Before JAX's runtime starts, the processes meet at the coordinator's port (``rendezvous``):
process 0 listens there and every other process says who it is, so the same
``--process-id`` twice, disagreeing ``--num-processes``, a port already in use, a
coordinator that never comes up and a process that never starts each end every process
within ``timeout`` seconds with one line naming the cause (``StartError``), where JAX's
runtime would abort (SIGABRT) with the cause only in its log. Then ``agree`` compares the
commands' arguments and a fingerprint of the checkpoints each process reads.

A process that dies or cannot be reached ends the others: JAX's coordination service
notices the missing heartbeats within ``timeout`` seconds and stops every process with an
error (each process prints one ``specjax: process I ...`` line where it can tell).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
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
    ``StartError`` (a ``RuntimeError``, one line naming the cause) when the run cannot
    start: explicit settings meet at the coordinator first (``rendezvous``), so the same
    process id twice, disagreeing process counts, a port in use, no coordinator and a
    missing process are each named within ``settings.timeout``."""
    s = settings.check()
    if s.explicit and s.num_processes == 1:
        return False
    if not s.explicit and not (detect and s.detected):
        return False
    if jax.distributed.is_initialized():
        return True
    if s.explicit:
        rendezvous(s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kw = dict(initialization_timeout=s.timeout, heartbeat_timeout_seconds=s.timeout)
    try:
        if s.explicit:
            jax.distributed.initialize(s.coordinator, s.num_processes, s.process_id, **kw)
        else:
            jax.distributed.initialize(**kw)
    except Exception as e:  # the runtime raises XlaRuntimeError / its own types
        where = f"the coordinator {s.coordinator}" if s.explicit else "the detected cluster"
        raise StartError(f"could not join {where} within {s.timeout} s: "
                         f"{str(e).splitlines()[0][:300]}") from None
    return True


# ----------------------------------------------------------------------------- rendezvous

class StartError(RuntimeError, ValueError):
    """A multi-process run that cannot start, in one line naming the cause. A
    ``RuntimeError`` (as ``initialize`` raised before) and a ``ValueError``, so the CLI
    prints it as it is (exit 1)."""


_HELLO = "specjax-rendezvous/1"


def _address(coordinator: str) -> tuple[str, int]:
    host, _, port = coordinator.rpartition(":")
    return host.strip("[]"), int(port)


def _me(s: Settings) -> dict:
    return {"hello": _HELLO, "process_id": s.process_id, "num_processes": s.num_processes,
            "host": socket.gethostname(), "pid": os.getpid()}


def _who(hello: dict) -> str:
    return f"host {hello.get('host')}, pid {hello.get('pid')}"


class _Conn:
    """A connection of the rendezvous: JSON lines both ways (a line read keeps what came
    after it for the next read)."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def send(self, message: dict) -> None:
        try:
            self.sock.sendall((json.dumps(message) + "\n").encode())
        except OSError:
            pass  # the other end is gone: its own read says so

    def read(self, timeout: float) -> dict | None:
        """The next message; None for anything else (EOF, another protocol's bytes,
        nothing within ``timeout`` seconds)."""
        end = time.monotonic() + timeout
        try:
            while b"\n" not in self.buf:
                if len(self.buf) > 65536 or time.monotonic() >= end:
                    return None
                self.sock.settimeout(max(end - time.monotonic(), 0.01))
                chunk = self.sock.recv(4096)
                if not chunk:
                    return None
                self.buf += chunk
            line, self.buf = self.buf.split(b"\n", 1)
            message = json.loads(line)
        except (OSError, ValueError):
            return None
        return message if isinstance(message, dict) and message.get("hello") == _HELLO else None

    def close(self) -> None:
        self.sock.close()


def _listen(port: int) -> socket.socket | None:
    """Process 0's listening socket on ``port`` of every interface (where JAX's service
    binds next, ``[::]:PORT``); None when the port is taken."""
    six = socket.has_dualstack_ipv6()
    try:
        return socket.create_server(("", port), family=socket.AF_INET6 if six else
                                    socket.AF_INET, dualstack_ipv6=six, backlog=128)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return None
        raise StartError(f"process 0 cannot listen on port {port}: {e.strerror or e}") from None


def _check(hello: dict, joined: dict, me: dict, s: Settings) -> str | None:
    """Why ``hello`` (a process's) cannot join process 0's run; None when it can."""
    i, n = hello.get("process_id"), hello.get("num_processes")
    if n != s.num_processes:
        return (f"process {i} ({_who(hello)}) was started with --num-processes {n}, process 0 "
                f"({_who(me)}) with {s.num_processes}: give every process the same count")
    if i == 0 or i in joined:
        first = me if i == 0 else joined[i]
        return (f"two processes were started with --process-id {i} ({_who(first)}; "
                f"{_who(hello)}): give each process its own id, 0 to {s.num_processes - 1}")
    if not isinstance(i, int) or not 0 < i < s.num_processes:
        return f"process {i} ({_who(hello)}) is not in [0, {s.num_processes})"
    return None


def rendezvous(settings: Settings) -> None:
    """The processes of an explicit run meet before JAX's runtime starts: process 0 listens
    on the coordinator's port until the other ``num_processes - 1`` have said who they are
    (their process id, process count, host and pid), then answers each and frees the port
    for JAX's service; the others connect until ``timeout``. ``StartError`` (one line, on
    every process that can be told) for the same process id twice, another process count,
    the port in use on process 0's host, no coordinator within ``timeout`` and a process
    that does not join within it."""
    s = settings
    host, port = _address(s.coordinator)
    deadline = time.monotonic() + s.timeout
    me = _me(s)
    if s.process_id != 0:
        _join(host, port, me, s, deadline)
        return
    server = _listen(port)
    if server is None:  # another process 0 of this run listens there, or another program
        reply = _ask(host, port, me, timeout=3)
        if reply is not None and reply.get("error"):
            raise StartError(reply["error"])
        raise StartError(f"--coordinator {s.coordinator}: port {port} is already in use on "
                         f"this host (another program, or a run already started there); "
                         f"free it or give every process another port")
    _serve(server, me, s, deadline)


def _ask(host: str, port: int, me: dict, timeout: float) -> dict | None:
    """``me`` sent to ``host:port`` and its answer; None for no answer of the protocol."""
    try:
        sock = socket.create_connection((host, port), timeout=min(timeout, 2.0))
    except OSError:
        return None
    conn = _Conn(sock)
    try:
        conn.send(me)
        reply = conn.read(timeout)
        return conn.read(timeout) if reply is not None and reply.get("wait") else reply
    finally:
        conn.close()


def _join(host: str, port: int, me: dict, s: Settings, deadline: float) -> None:
    """A process other than 0: connects to process 0 until ``deadline``, says who it is
    and waits for process 0's answer (which comes within process 0's own timeout)."""
    last: OSError | None = None
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=2.0)
            break
        except socket.gaierror as e:
            raise StartError(f"--coordinator {s.coordinator}: the host name {host!r} does not "
                             f"resolve ({e.strerror or e})") from None
        except OSError as e:
            last = e
            if time.monotonic() >= deadline:
                raise StartError(
                    f"the coordinator {s.coordinator} did not come up within {s.timeout} s "
                    f"({(last.strerror or str(last)).lower()}): is process 0 started, on that "
                    f"host, with --coordinator {s.coordinator}?") from None
            time.sleep(0.2)
    conn = _Conn(sock)
    try:
        conn.send(me)
        reply = conn.read(3.0)  # process 0 acknowledges at once, then answers
        if reply is not None and reply.get("wait"):
            reply = conn.read(s.timeout + 5)
    finally:
        conn.close()
    if reply is None:
        raise StartError(f"the coordinator {s.coordinator} answered, but not as process 0 of "
                         f"a specjax run that is starting: the run started without this process "
                         f"(is --process-id {s.process_id} given twice?), process 0 stopped, or "
                         f"another program holds the port")
    if reply.get("error"):
        raise StartError(reply["error"])


def _serve(server: socket.socket, me: dict, s: Settings, deadline: float) -> None:
    """Process 0: accepts the others until all have joined (and 0.5 s more, for a process
    id given twice) or ``deadline``; answers every process that connected."""
    joined: dict[int, dict] = {}
    conns: list[_Conn] = []
    error = None
    complete_at = None
    server.settimeout(0.1)
    try:
        while error is None:
            now = time.monotonic()
            if len(joined) == s.num_processes - 1:
                complete_at = complete_at or now
                if now - complete_at >= 0.5:
                    break
            elif now >= deadline:
                missing = [str(i) for i in range(1, s.num_processes) if i not in joined]
                error = (f"only {len(joined) + 1} of {s.num_processes} processes joined the "
                         f"coordinator {s.coordinator} within {s.timeout} s: process "
                         f"{', '.join(missing)} did not (is it started, with --coordinator "
                         f"{s.coordinator} and --num-processes {s.num_processes}?)")
                break
            try:
                conn = _Conn(server.accept()[0])
            except (socket.timeout, BlockingIOError):
                continue
            hello = conn.read(2.0)
            if hello is None:  # not a process of a run (a port scanner, a health check)
                conn.close()
                continue
            conns.append(conn)
            conn.send({"hello": _HELLO, "wait": True})
            error = _check(hello, joined, me, s)
            if error is None:
                joined[hello["process_id"]] = hello
        answer = {"hello": _HELLO, "error": error} if error else {"hello": _HELLO, "ok": True}
        for conn in conns:
            conn.send(answer)
        for conn in conns:  # the others close first: no TIME_WAIT on the port here
            conn.read(1.0)
    finally:
        for conn in conns:
            conn.close()
        server.close()
    if error:
        raise StartError(error)


_AGREED = 0

#: the arguments naming checkpoints (or files) every process reads: ``agree`` compares a
#: fingerprint of what each names on its own host (``fingerprint``), not only the strings
CHECKPOINT_ARGS = ("model", "draft_checkpoint", "redrafter_checkpoint", "exit_heads", "init",
                   "calibration")
#: the files of a checkpoint directory a fingerprint covers: what transformers and specjax
#: read (configs, tokenizers, weights), not READMEs or hidden files
_READ = {".json", ".safetensors", ".gguf", ".bin", ".pt", ".pth", ".model", ".txt",
         ".tiktoken", ".npz", ".npy"}
_WHOLE, _CHUNK, _SAMPLES = 1 << 20, 4096, 64


def _digest(path: Path) -> str:
    """A cheap digest of one file: its size and, for a file of up to 1 MiB, all of it;
    for a larger one its first MiB (a safetensors file: its whole header), and 64 blocks of
    4 KiB spread evenly over the rest (256 KiB read of any file, whatever its size)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(f"{size}:".encode())
    with open(path, "rb") as f:
        if size <= _WHOLE:
            h.update(f.read())
            return h.hexdigest()[:16]
        head = _WHOLE
        if path.suffix == ".safetensors":
            n = int.from_bytes(f.read(8), "little")
            head = min(max(head, 8 + n), size, 256 << 20)
            f.seek(0)
        h.update(f.read(head))
        span = size - head - _CHUNK
        for k in range(_SAMPLES):
            f.seek(head + max(span, 0) * k // (_SAMPLES - 1))
            h.update(f.read(_CHUNK))
    return h.hexdigest()[:16]


def fingerprint(name_or_path, resolve=None) -> dict[str, str] | None:
    """``{file name: digest}`` of the checkpoint a path names on this host (or a name
    ``resolve`` turns into a path: the CLI passes the model registry's): the file itself,
    or a directory's configs, tokenizer and weight files (top level; ``_READ``), each
    digested by ``_digest`` (sizes, headers and 256 KiB sampled through each large file;
    weights are not read whole). None for a path that does not exist here (the command
    itself then says so)."""
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path):
        return None
    p = Path(name_or_path)
    if not p.exists():
        try:
            p = Path(resolve(str(name_or_path)))
        except Exception:  # noqa: BLE001 -- not a name it knows either: nothing to compare
            return None
    try:
        if p.is_file():
            return {p.name: _digest(p)}
        if p.is_dir():
            return {f.name: _digest(f) for f in sorted(p.iterdir()) if f.is_file()
                    and not f.name.startswith(".") and f.suffix.lower() in _READ}
    except OSError:
        return None
    return None


def _differs(name: str, mine: dict | None, theirs: dict | None) -> str:
    """Which file of ``name`` differs between two fingerprints, in a few words."""
    if mine is None or theirs is None:
        return "it exists on one of them only"
    for f in sorted(set(mine) | set(theirs)):
        if f not in mine or f not in theirs:
            return f"{f} exists on one of them only"
        if mine[f] != theirs[f]:
            return f"{f} differs"
    return "its files differ"


def agree(settings: Settings, values: dict, resolve=None) -> None:
    """``ValueError`` (one line) unless every process of the run was started with the same
    ``values`` (a command's arguments, its own process id and log paths left out), the
    process count that ``settings`` names, and, for each argument of ``CHECKPOINT_ARGS``,
    the same files on its own host (``fingerprint``: the same ``--model`` path may hold
    other weights on another host; ``resolve`` turns a registered name into its path).
    Exchanged through the coordination service's
    key-value store before any weight is read; waits ``settings.timeout`` at most."""
    if jax.process_count() == 1:
        return
    if settings.explicit and settings.num_processes != jax.process_count():
        raise ValueError(f"--num-processes {settings.num_processes}, but process 0 started a "
                         f"run of {jax.process_count()} processes")
    from jax._src.distributed import global_state

    global _AGREED
    _AGREED += 1  # one key per call: a process may run several commands
    inputs = {k: fingerprint(values[k], resolve) for k in CHECKPOINT_ARGS if values.get(k)}
    args = json.dumps(values, sort_keys=True, default=str)
    client, me = global_state.client, jax.process_index()
    host = socket.gethostname()
    client.key_value_set(f"specjax/args/{_AGREED}/{me}", json.dumps(
        {"args": args, "inputs": inputs, "host": host}))
    for other in range(jax.process_count()):
        try:
            got = json.loads(client.blocking_key_value_get(f"specjax/args/{_AGREED}/{other}",
                                                           settings.timeout * 1000))
        except Exception as e:  # noqa: BLE001 -- the runtime's DEADLINE_EXCEEDED and kin
            if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e):
                raise
            raise ValueError(f"process {other} did not send its arguments within "
                             f"{settings.timeout} s (it stopped or hangs; see its log)") from None
        if got["args"] != args:
            a, b = json.loads(args), json.loads(got["args"])
            diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            raise ValueError(f"process {other} was started with other arguments: "
                             + ", ".join(f"{k}={b.get(k)!r} there, {a.get(k)!r} here"
                                         for k in diff[:3]))
        for k in inputs:
            theirs = got["inputs"].get(k)
            if theirs != inputs[k]:
                lo, hi = sorted([(me, host), (other, got["host"])])
                flag = "--" + k.replace("_", "-")
                raise ValueError(
                    f"{flag} {values[k]} is not the same checkpoint on process {lo[0]} (host "
                    f"{lo[1]}) and process {hi[0]} (host {hi[1]}): "
                    f"{_differs(k, inputs[k], theirs)} (sizes, headers and sampled bytes "
                    f"compared); give every process the same files")


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
    main = rank == "0"
    env = {**os.environ, WORKER_ENV: "1", "PYTHONUNBUFFERED": "1"}
    with open_log(log, "--log-dir") as f:
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


def open_log(path: Path, flag: str):
    """``path`` opened for writing (line-buffered), its directory made first; a
    ``UsageError`` (exit 2) in one line naming ``flag`` when it cannot be: a file where the
    directory should be, a directory below a file, no permission."""
    from specjax._errors import UsageError

    where = path.parent
    try:
        where.mkdir(parents=True, exist_ok=True)
        return open(path, "w", buffering=1)
    except OSError as e:
        block = next((q for q in (where, *where.parents) if q.exists() and not q.is_dir()), None)
        cause = (f"{block} is a file, not a directory" if block is not None
                 else f"{e.filename or path}: {e.strerror or e}")
        raise UsageError(f"{flag} {where}: cannot write the process logs there: {cause}; give "
                         f"a directory path") from None


#: the runtime's fatal errors (``F... client.h] Terminating process ... absl::Status: ...``),
#: each with the cause it means at start-up
_ABORTS = (
    (re.compile(r"newer incarnation|ALREADY_EXISTS.{0,300}RegisterTask", re.S),
     "another process joined the run with this --process-id (the same id given twice?)"),
    (re.compile(r"DEADLINE_EXCEEDED.{0,300}RegisterTask|RegisterTask.{0,300}DEADLINE_EXCEEDED",
                re.S),
     "not every process joined the coordinator within {timeout} s (a process not started, "
     "another --coordinator or --num-processes, or the same --process-id twice)"),
)


def why(text: str, returncode: int, settings: Settings) -> str:
    """The cause of a worker's exit, in a few words, from its log and exit status: its own
    ``specjax:`` line, else what the runtime printed before it aborted."""
    err = [ln for ln in text.splitlines() if ln.startswith("specjax: ")]
    if err:
        return err[-1].removeprefix("specjax: ")
    for pattern, cause in _ABORTS:
        if pattern.search(text):
            return "stopped: " + cause.format(timeout=settings.timeout)
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
    status = re.findall(r"absl::Status: ([^\n]+)", text)
    last = status[-1].strip()[:200] if status else _last_words(text)
    tail = f": {last}" if last else ""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"killed by signal {name}{tail}"
    return f"exited with status {returncode}{tail}"


def _last_words(text: str) -> str:
    """The last line of ``text`` that is not the runtime's noise (a traceback's last
    line, an error), cut to 200 characters; empty when there is none."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not _NOISE.match(ln)
             and not ln.startswith(("Traceback", "  File ", "    "))]
    return lines[-1][:200] if lines else ""


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


def _parser():
    """The launcher's flags; errors in one line, ``specjax: error: ...``, exit 2."""
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            self.exit(2, f"specjax: error: {message} (see `{self.prog} -h`)\n")

    p = Parser(prog="python -m specjax.distributed", description=(
        "Runs COMMAND as N local processes of one multi-process JAX run (on CPU: simulated "
        "devices, gloo collectives), each given --coordinator 127.0.0.1:PORT (a free port), "
        "--num-processes N and --process-id I after its own arguments. Prints process 0's "
        "output, then each process's exit status and log; a process that fails gets one "
        "line naming the cause. Run it with the project's environment (.venv/bin/python), "
        "which has specjax installed."),
        epilog="example: .venv/bin/python -m specjax.distributed -n 3 --devices 1 -- "
               ".venv/bin/specjax generate --model smollm2-135m --mesh model=3 --prompt hi")
    p.add_argument("-n", "--processes", type=int, default=2,
                   help="how many processes to start, 1 or more (default 2)")
    p.add_argument("--devices", type=int, default=2,
                   help="simulated CPU devices per process, 1 or more (default 2): the run "
                        "has N x DEVICES devices for its mesh")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds the run may take in all; past it, every process left is "
                        "killed (default 3600)")
    p.add_argument("--log-dir", default="specjax-logs/launcher",
                   help="each process's output (what the command printed) goes to "
                        "LOG_DIR/process-I.log (default specjax-logs/launcher; a specjax "
                        "command's own logs go to its --log-dir, default specjax-logs)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="after --: the command each process runs, e.g. .venv/bin/specjax "
                        "generate ... --mesh model=4")
    return p


def _cause(r: Result) -> str:
    """A failed process's cause in one line: its own last ``specjax:`` line (without the
    ``specjax: process I:`` prefix), else what its output shows (``why``)."""
    text = why(r.output, r.returncode, Settings(timeout=300))
    return re.sub(rf"^process {r.process_id}: ", "", text)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specjax.distributed -n N [--devices D] -- COMMAND ...``: COMMAND as N
    local processes (``launch``), each given ``--coordinator``, ``--num-processes`` and
    ``--process-id`` after its arguments; prints each process's log path and exit status
    (and a failed process's cause, in one line), and process 0's output. Exits with the
    first non-zero status; 2 for flags it cannot run (one line, before any process
    starts)."""
    import shutil

    p = _parser()
    a = p.parse_args(argv)
    cmd = [c for c in a.command if c != "--"]
    if not cmd:
        p.error("give the command to run after --")
    if a.processes < 1:
        p.error(f"-n must be >= 1 (processes to start), got {a.processes}")
    if a.devices < 1:
        p.error(f"--devices must be >= 1 (simulated CPU devices per process), got {a.devices}")
    if not a.timeout > 0:
        p.error(f"--timeout must be > 0 s, got {a.timeout}")
    if shutil.which(cmd[0]) is None:
        p.error(f"{cmd[0]}: no such command (give a path, or a program on PATH)")
    from specjax._errors import UsageError

    try:
        open_log(Path(a.log_dir) / "process-0.log", "--log-dir").close()
    except UsageError as e:
        p.error(str(e))
    cmd += ["--coordinator", "{coordinator}", "--num-processes", "{num_processes}",
            "--process-id", "{process_id}"]
    results = launch(cmd, a.processes, devices=a.devices, timeout=a.timeout,
                     log_dir=a.log_dir)
    sys.stdout.write(results[0].output)
    for r in results:
        said = f": {_cause(r)}" if r.returncode else ""
        print(f"[process {r.process_id}] exit {r.returncode}{said}, log {a.log_dir}/process-"
              f"{r.process_id}.log", file=sys.stderr)
    rc = next((r.returncode for r in results if r.returncode), 0)
    return rc if rc >= 0 else 1


if __name__ == "__main__":
    sys.exit(main())
