"""The ``specjax`` command: demo, generate, bench, calibrate, tune, distill, self-prompts,
features, train and convert-head. Each command lives in ``specjax.commands``; methods are built by
``specjax.methods``; this module only assembles the parser and reports errors."""

from __future__ import annotations

import argparse
import os
import sys

from specjax._optional import MissingExtra
from specjax.commands import bench, convert, decode, hsd, train
from specjax.commands.common import UsageError, check_args, distributed_settings

# errors whose message says it all: printed without the exception's name or a traceback hint
_CLEAN = (UsageError, ValueError, FileNotFoundError, IsADirectoryError, MissingExtra)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``specjax: error: ...``, exit code 2."""

    def error(self, message):
        self.exit(2, f"specjax: error: {message} (see `{self.prog} -h`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="specjax", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    p.set_defaults(debug=False)
    for module in (decode, bench, hsd, train, convert):
        for sp in module.register(sub):  # each command's parsers that run something
            sp.add_argument("--debug", action="store_true",
                            help="show the full traceback of an error (or SPECJAX_DEBUG=1)")
    return p


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    text = msg[0] if msg else ""
    if not isinstance(e, _CLEAN) or not text:
        text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text


def main(argv=None) -> int:
    """Runs one command. Errors print one line, ``specjax: error: ...``, and exit with 2 for
    a usage mistake and 1 otherwise; ``--debug`` or ``SPECJAX_DEBUG=1`` shows the traceback."""
    from specjax.jax_setup import setup_jax

    setup_jax()  # before any backend starts: the CLI's XLA flag and compilation cache
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("SPECJAX_DEBUG", "") not in ("", "0")
    try:
        check_args(args)
        settings = distributed_settings(args)
        if settings is not None and _supervise(settings, args):
            from specjax import distributed

            return distributed.supervise(sys.argv[1:] if argv is None else list(argv),
                                         settings, args.log_dir)
        if settings is not None:
            from specjax import distributed

            if distributed.initialize(settings, detect=bool(getattr(args, "mesh", None))):
                from specjax.models.registry import resolve

                distributed.agree(settings, _same_everywhere(args), resolve)
        return args.fn(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print("specjax: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 -- the CLI's one place that reports errors
        if debug:
            raise
        clean = isinstance(e, _CLEAN)
        hint = "" if clean else " (--debug shows the traceback)"
        print(f"specjax: error: {_one_line(e)}{hint}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1


def _same_everywhere(args) -> dict:
    """The arguments every process of a run must share: all but its own id and log paths."""
    own = {"process_id", "log_dir", "coordinator", "debug", "fn"}
    return {k: v for k, v in vars(args).items() if k not in own}


def _supervise(settings, args) -> bool:
    """Whether this command starts a multi-process run (explicit flags of N > 1 processes,
    or ``--mesh`` in a cluster JAX detects) and is not yet its worker: then it runs the
    command in a child process that it watches (``distributed.supervise``)."""
    from specjax import distributed

    multi = ((settings.num_processes or 0) > 1 if settings.explicit
             else bool(getattr(args, "mesh", None)) and settings.detected)
    return multi and not os.environ.get(distributed.WORKER_ENV)


if __name__ == "__main__":
    sys.exit(main())
