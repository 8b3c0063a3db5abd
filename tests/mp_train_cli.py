"""One process of a multi-process ``specjax train`` run on a toy target, for
tests/test_multiprocess_train.py (started N times by ``specjax.distributed.launch``).

``python tests/mp_train_cli.py ARGS [--then ARGS ...]`` runs ``specjax.cli.main(ARGS)``
for each ``--then``-separated command in turn, in this one process (so a second command
reuses the first one's compiled programs), with ``specjax.models.load`` replaced by the
toy of ``toy_lm`` (built at the first load, after the run is joined): the 2-layer ``toys.LLAMA_TRAIN`` Llama with the parameters of
``jax.random.key(4)`` times 3 (tests/test_train.py's toy), identical in every process. The
process is the run's worker itself (``SPECJAX_DISTRIBUTED_WORKER=1``): the CLI joins the
run (``distributed.initialize``) instead of starting a supervised child; the processes'
arguments are compared (``distributed.agree``) for the first command only. Exits with the
first non-zero status. ``MP_TRAIN_KILL=P:STEP`` kills process ``P`` after its part of
checkpoint ``STEP`` (``_kill_after_save``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def toy_lm():
    """The toy target every process (and the test's one-process reference) trains on: a
    ``LoadedModel`` named ``toy`` with a ``toys.ByteTokenizer`` (10 ids at most) and stop
    token 0."""
    import jax

    import toys
    from specjax.models.llama import Llama, init_params
    from specjax.models.registry import LoadedModel

    cfg = toys.LLAMA_TRAIN
    params = jax.tree.map(lambda x: x * 3.0, init_params(cfg, jax.random.key(4)))
    return LoadedModel("toy", Llama(cfg), params, toys.ByteTokenizer(cfg.vocab_size, limit=10),
                       (0,), Path("toy"))


def _kill_after_save(spec: str) -> None:
    """``MP_TRAIN_KILL=P:STEP``: process ``P`` kills itself (SIGKILL) once its part of the
    checkpoint of ``STEP`` is written, as a host lost mid-run (nothing when unset)."""
    if not spec:
        return
    import signal

    import jax
    import orbax.checkpoint as ocp

    who, step = (int(x) for x in spec.split(":"))
    save = ocp.CheckpointManager.save

    def save_then_die(self, s, *args, **kwargs):
        out = save(self, s, *args, **kwargs)
        if s == step and jax.process_index() == who:
            self.wait_until_finished()
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    ocp.CheckpointManager.save = save_then_die


def commands(argv: list[str]) -> list[list[str]]:
    """``argv`` split at each ``--then``."""
    out = [[]]
    for a in argv:
        if a == "--then":
            out.append([])
        else:
            out[-1].append(a)
    return [c for c in out if c]


def main(argv: list[str]) -> int:
    from specjax import distributed

    os.environ[distributed.WORKER_ENV] = "1"
    import specjax.models

    made = []  # built at the first load, after the CLI joined the run: no JAX call before

    def load(*args, **kwargs):
        made[:] = made or [toy_lm()]
        return made[0]

    specjax.models.load = load
    once = distributed.__dict__.get("agree")
    if once is not None:  # the arguments' agreement keeps one key per process in JAX's
        calls = []        # key-value store: checked for the first command alone

        def agree(*args, **kwargs):
            calls.append(1)
            return once(*args, **kwargs) if len(calls) == 1 else None

        distributed.agree = agree
    _kill_after_save(os.environ.get("MP_TRAIN_KILL", ""))
    from specjax import cli

    for cmd in commands(argv):
        rc = cli.main(cmd)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
