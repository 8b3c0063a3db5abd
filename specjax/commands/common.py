"""What every ``specjax`` command shares: the usage error, argument checks that need no
model, output paths checked before any work, the options' argparse groups, and the
translation of arguments into a ``specjax.methods`` spec and ``Options``."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from specjax._errors import UsageError  # noqa: F401  (the base layer raises it too)

_POSITIVE = ("max_new_tokens", "limit", "draft_len", "steps", "batch_tokens", "max_len",
             "tokens", "num_prompts", "batch", "save_every", "threads", "t_max", "max_levels",
             "rank", "random_prompts", "prompt_len")


def check_args(args) -> None:
    """Checks that need no model: sampling values (finite), budgets, the prompt."""
    for name in ("temperature", "top_p", "draft_temperature", "lr"):
        v = getattr(args, name, None)
        if v is not None and not math.isfinite(v):
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number, got {v}")
    if getattr(args, "temperature", 0.0) < 0:
        raise UsageError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if getattr(args, "top_k", 0) < 0:
        raise UsageError(f"--top-k must be >= 0 (0: no limit), got {args.top_k}")
    if not 0 < getattr(args, "top_p", 1.0) <= 1:
        raise UsageError(f"--top-p must be in (0, 1] (1: no limit), got {args.top_p}")
    for name in _POSITIVE:
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if getattr(args, "prompt", None) is not None and not args.prompt.strip():
        raise UsageError("--prompt is empty")


def writable(path: str | None, flag: str, directory: bool = False) -> None:
    """Raises ``UsageError`` unless ``path`` can be written as a file (``directory``: as a
    directory, existing or not): not an existing entry of the other kind, and below a
    writable directory. Missing parents are fine (they are created when written)."""
    if path is None:
        return
    p = Path(path)
    if p.exists() and p.is_dir() != directory:
        what = "a directory" if p.is_dir() else "a file"
        raise UsageError(f"{flag} {path} is {what}; give a {'directory' if directory else 'file'}"
                         " path")
    if p.exists():  # an existing entry of the right kind: it must be writable itself
        if not os.access(p, os.W_OK):
            raise UsageError(f"{flag} {path} cannot be written: it is not writable")
        return
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path} cannot be written: {parent} is a file")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {path} cannot be written: {parent} is not writable")


def readable(path: str | None, flag: str, directory: bool = False) -> None:
    """Raises ``UsageError`` unless ``path`` (None: the default, nothing to check) exists
    as a file (``directory``: as a directory); what it holds is checked when read."""
    if path is None:
        return
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{flag} {path} does not exist")
    if p.is_dir() != directory:
        raise UsageError(f"{flag} {path} is {'a directory' if p.is_dir() else 'a file'}; give "
                         f"a {'directory' if directory else 'file'}")


def dtypes(args) -> dict:
    """``load``'s storage and compute dtypes from ``--dtype`` and ``--compute-dtype``."""
    import jax.numpy as jnp

    names = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
    scan = {"scan_layers": True} if getattr(args, "scan_layers", False) else {}
    return {"dtype": names[args.dtype], "compute_dtype": names[args.compute_dtype], **scan}


def sampler(args):
    import specjax

    if args.temperature <= 0:
        return specjax.Greedy()
    return specjax.Sample(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def mesh(args, rows: int | None = 1):
    """The ``--mesh``, or None; ``rows``: the batch it must divide (None: any, as training
    pads its batches)."""
    if not getattr(args, "mesh", None):
        return None
    from specjax import sharding

    try:
        sizes = sharding.parse_mesh(args.mesh)
        from specjax import distributed

        distributed.check_devices(sizes["data"] * sizes["model"])
        m = sharding.make_mesh(**sizes)
        if rows is not None:  # generate and bench decode one prompt at a time
            sharding.check_batch(rows, m)
    except ValueError as e:
        raise UsageError(f"--mesh {args.mesh}: {e}") from None
    return m


def load(args, m, **kw):
    """``specjax.models.load`` of ``--model`` at the CLI's dtypes, each weight placed
    straight onto mesh ``m`` (each device receives only its slice); a mesh the model
    cannot be split over is a ``UsageError`` before any weight is read."""
    from specjax import sharding
    from specjax.models import load, loading, registry

    if m is not None:
        path = registry.resolve(args.model)
        cfg = loading.hf_dir_config(path) if path.is_dir() else loading.gguf_file_config(path)
        try:
            sharding.check_model(cfg, m)
        except ValueError as e:
            raise UsageError(f"--mesh {args.mesh}: {e}") from None
    lm = load(args.model, **dtypes(args), mesh=m, **kw)
    if getattr(args, "check_weights", False):
        from specjax.models import check_finite

        check_finite(lm.params)  # a NaN or an infinity named, before anything compiles
    return lm


def method_text(args) -> str:
    """``--method`` as one ``specjax.methods`` text form: a full spec (``eagle2:3,4,7``,
    ``sd-ngram:7``, ``hsd:ngram:4,target``) as given, or a registered method's bare name
    completed by its flag (``Method.cli``: ``sd`` + ``--drafter``, ``eagle2`` +
    ``--eagle``, ``redrafter`` + ``--redrafter``, ``hsd`` + ``--hierarchy``)."""
    from specjax import methods

    for cls in methods.registered():
        if cls.cli is not None and args.method == cls.cli.bare:
            return cls.complete(getattr(args, cls.cli.dest))
    return args.method


def parse_method(text: str):
    from specjax import methods

    try:
        return methods.parse(text)
    except methods.SpecError as e:
        raise UsageError(str(e)) from None


def check_method(spec, args) -> None:
    """``specjax.methods.check``, before the model loads: the head directories and the
    calibration ``spec`` reads; a spec error reported as a usage error."""
    from specjax import methods
    from specjax.methods.registry import WidthsError

    try:
        methods.check(spec, options(args))
    except WidthsError as e:
        raise UsageError(f"--verify-widths {args.verify_widths}: {e}") from None
    except methods.SpecError as e:
        raise UsageError(str(e)) from None


def scratch(specs, args) -> int:
    """The most cache slots one round of any decoding spec of ``specs`` writes past a
    row's budget (``Method.scratch``: its draft and root; 0 where only the build knows)."""
    opts = options(args)
    return max([spec.scratch(opts) or 0 for spec in specs if spec.decodes], default=0)


def config_check(args, specs, then=None):
    """A ``load(check=...)`` hook that runs before any weight is read: each decoding spec
    of ``specs`` against the model's config (``Method.check_config``: exit layers within
    the model's layers and among its exit heads), a spec error reported as a usage error;
    then ``then(tokenizer, cfg)``, if given."""
    def check(tokenizer, cfg):
        from specjax import methods

        opts = options(args)
        for spec in specs:
            if spec.decodes:
                try:
                    spec.check_config(cfg, opts)
                except methods.SpecError as e:
                    raise UsageError(str(e)) from None
        if then is not None:
            then(tokenizer, cfg)
    return check


def options(args):
    """``specjax.methods.Options`` from the arguments a command has."""
    from specjax import methods

    get = lambda name, default=None: getattr(args, name, default)
    widths = get("verify_widths")
    try:
        layers = tuple(int(x) for x in get("layers", "4,8,12,16,20,24").split(","))
    except ValueError:
        raise UsageError(f"--layers must be comma-separated ints, got {args.layers!r}") from None
    return methods.Options(
        model_name=args.model, draft_len=get("draft_len"),
        widths=None if widths in (None, "auto") else widths,
        draft_checkpoint=get("draft_checkpoint"),
        redrafter_checkpoint=get("redrafter_checkpoint"), exit_heads=get("exit_heads"),
        layers=layers, calibration=get("calibration"), t_max=get("t_max", 8),
        max_levels=get("max_levels", 4), horizontal=tuple(get("horizontal", (0,))))


def build(spec, lm, args):
    """``specjax.methods.build`` with a spec error reported as a usage error."""
    from specjax import methods

    try:
        return methods.build(spec, lm, options(args))
    except methods.SpecError as e:
        raise UsageError(str(e)) from None


# ----------------------------------------------------------------------------- options


def sizes(text: str) -> tuple[int, ...]:
    """``"0,10"`` -> ``(0, 10)``: non-negative ints (argparse type)."""
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative ints like 0,10, got {text!r}")
    return out


def add_model(s, max_new: int = 128) -> None:
    s.add_argument("--model", default="smollm2-135m",
                   help="registered name, .gguf file or HF directory")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights and KV cache")
    s.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="inputs of every product (default float32: bfloat16 weights then "
                        "keep greedy output equal to ar's as in float32; bfloat16 is faster "
                        "on bfloat16 hardware and can leave ar on near-ties)")
    s.add_argument("--max-new-tokens", type=int, default=max_new)
    s.add_argument("--scan-layers", action="store_true",
                   help="Llama models: run the layers under one lax.scan over stacked weights "
                        "(one layer compiles, not all; slower per token: 1.3-1.9x on CPU, "
                        "2.9x for Llama-3.1-8B on an H200)")


def add_check_weights(s) -> None:
    s.add_argument("--check-weights", action="store_true",
                   help="refuse weights holding a NaN or an infinity, naming the first "
                        "(specjax.models.check_finite; one pass over the weights after they "
                        "load); unchecked, such weights decode token 0 with no error")


def width_policy(text: str) -> str:
    """``text`` when it reads as a verification-width policy (argparse type; which widths
    fit the method is checked with the method)."""
    from specjax.core import widths

    try:
        widths.as_policy(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_verify_widths(s) -> None:
    s.add_argument("--verify-widths", default="auto", type=width_policy,
                   help="verification widths compiled for speculative methods: auto (padded "
                        "off CPU, merged on CPU), padded (one forward at the full draft), "
                        "per-width (the drafter's own), merged (per-width, widths with equal "
                        "product padding merged) or widths, e.g. 1,8")


def add_mesh(s) -> None:
    s.add_argument("--mesh", help="run on a device mesh, e.g. model=3: weights split by heads "
                   "and MLP columns (data=D needs batches of D rows; these commands decode "
                   "one prompt at a time)")
    add_distributed(s)


def add_distributed(s) -> None:
    """The multi-process flags of every command that takes ``--mesh``
    (``specjax.distributed.Settings``)."""
    g = s.add_argument_group("multi-process runs (one process per host; the mesh spans "
                             "every process's devices)")
    g.add_argument("--coordinator", help="HOST:PORT of process 0 (with --num-processes and "
                   "--process-id); none of the three: JAX detects a TPU pod, SLURM or Open MPI")
    g.add_argument("--num-processes", type=int, help="processes in the run")
    g.add_argument("--process-id", type=int, help="this process, 0 .. N-1 (0 prints results "
                   "and writes files)")
    g.add_argument("--distributed-timeout", type=int, default=300, help="seconds to wait for "
                   "every process at start-up, and for a silent one before the run ends "
                   "(default 300, JAX's own)")
    g.add_argument("--log-dir", default="specjax-logs", help="each process's log, "
                   "process-I.log, goes here (default: specjax-logs)")


def distributed_settings(args):
    """The ``specjax.distributed.Settings`` of a command's flags; None for a command without
    them. ``UsageError`` for flags that cannot describe a run."""
    if not hasattr(args, "coordinator"):
        return None
    from specjax import distributed

    s = distributed.Settings(args.coordinator, args.num_processes, args.process_id,
                             args.distributed_timeout)
    try:
        return s.check()
    except ValueError as e:
        raise UsageError(str(e)) from None


def config_flags(s, cls, *, skip=(), defaults: dict | None = None) -> list:
    """One flag of the parser ``s`` per field of the config dataclass ``cls`` (declared
    by ``specjax.train.glue.option``), in field order: ``--kebab-case`` of its name (or its
    ``flag``), the default's type, ``store_true`` for a bool, the field's help with the
    default shown; ``skip``: fields the command gives itself, ``defaults``: the command's
    own default of a field. ``glue.from_args`` reads them back. Returns the flags."""
    import dataclasses

    from specjax.train import glue

    out = []
    for f in dataclasses.fields(cls):
        m = f.metadata
        if f.name in skip or not m.get("cli", True):
            continue
        kw: dict = {"default": f.default}
        if isinstance(f.default, bool):
            kw["action"] = "store_true"
        elif isinstance(f.default, tuple):
            kw.update(type=str, default=",".join(map(str, f.default)))
        elif f.default is not None:
            kw["type"] = type(f.default)
        kw.update(m.get("argparse", {}))
        if defaults and f.name in defaults:
            kw["default"] = defaults[f.name]
        text = m.get("help", f"{cls.__name__}.{f.name}").replace("%", "%%")
        if "action" not in kw and kw["default"] is not None:
            text += " (default: %(default)s)"
        s.add_argument(glue.flag_of(f), help=text, **kw)
        out.append(glue.flag_of(f))
    return out


def add_heads(s) -> None:
    s.add_argument("--draft-checkpoint", help="an EAGLE head directory: one specjax exported, "
                   "or a published EAGLE-1/2 or EAGLE-3 head (config.json and "
                   "pytorch_model.bin or model.safetensors); default: the head shipped for "
                   "--model")
    s.add_argument("--redrafter-checkpoint", help="an exported ReDrafter head directory "
                                                  "(default: the head shipped for --model)")


def add_exits(s) -> None:
    s.add_argument("--exit-heads", help="exported exit heads (default: the ones shipped for "
                                        "--model, else plain early exits)")
    s.add_argument("--layers", default="4,8,12,16,20,24",
                   help="exit layers when no exit heads are given or shipped")


def add_horizontal(s) -> None:
    s.add_argument("--horizontal", type=sizes, default=(0,), help="horizontal-heuristic sizes "
                   "the tuner tries, e.g. 0,10 (default: 0, off)")


def add_hsd(s) -> None:
    add_exits(s)
    s.add_argument("--calibration", help="JSON from `specjax calibrate` (hsd auto)")
    s.add_argument("--t-max", type=int, default=8, help="largest T the tuner tries")
    s.add_argument("--max-levels", type=int, default=4, help="most levels the tuner tries")
    add_horizontal(s)


def add_sampling(s) -> None:
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)


def method_help() -> str:
    """``--method``'s help, from the registered decoding methods: their bare names, the
    flags completing them, and an example of each full spec."""
    from specjax import methods

    decoding = [c for c in methods.registered() if c.decodes]
    bare = [c.cli.bare if c.cli else _bare(c) for c in decoding]
    flags = [c.cli.flag for c in decoding if c.cli]
    examples = [c.example for c in decoding if c.example]
    return (f"{' | '.join(bare)}, completed by {', '.join(flags)}; or a full method spec "
            f"such as {', '.join(examples)}. Forms: {'; '.join(c.usage for c in decoding)}")


def _bare(cls) -> str:
    """What ``--method`` takes for a registered class without a completion flag: its name
    where that parses alone, else its first text form (e.g. ``sd-repeat:K``)."""
    from specjax import methods

    name = cls.prefixes[0].rstrip("-")
    try:
        cls.parse(name)
        return name
    except methods.SpecError:
        return cls.forms[0]


def add_method(s) -> None:
    """``--method`` and what completes it (see ``method_text``): each registered method's
    ``cli`` flag."""
    from specjax import methods

    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--method", default="ar", help=method_help())
    for cls in methods.registered():
        if cls.cli is not None:
            s.add_argument(cls.cli.flag, default=cls.cli.default, help=cls.cli.help)
    s.add_argument("--draft-len", type=int, help="draft tokens per round (default: the "
                                                  "drafter's own)")
    add_heads(s)
    add_hsd(s)
    add_verify_widths(s)
