"""Compile time of every decoding method with JAX's persistent compilation cache
(``specjax._cache``): a first process starting from an empty cache, then a second process
reading what the first wrote.

Each pass is a fresh interpreter (this script with ``--child``) that sets
``SPECJAX_CACHE`` to one temporary directory, loads the model and, for every method of
``scripts/device_check.py``'s ``ALL_METHODS``, builds it as the device check does
(random EAGLE/EAGLE-3/ReDrafter heads: compile cost does not depend on the weights) and
decodes one random prompt. ``compile_s`` is the lowering plus compilation of the method's
decode program (``specjax._compile.AotCache``: what ``specjax bench`` reports),
``first_call_s`` the whole first call including every small jit around it; ``cache_hits``
and ``cache_writes`` count the persistent cache's reads and writes during the method
(``jax.monitoring`` events). Methods run in the listed order in one process, so in the
first pass a method may already reuse a program an earlier method wrote (the prefill).

    .venv/bin/python scripts/compile_cache.py --out docs/results/compile_cache_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specjax.jax_setup import setup_jax  # noqa: E402

setup_jax()  # as the specjax commands run: XLA:CPU's in-place flag, the compilation cache

ROOT = Path(__file__).resolve().parents[1]

_EVENTS = {"/jax/compilation_cache/cache_hits": "cache_hits",
           "/jax/compilation_cache/cache_misses": "cache_writes",
           "/jax/compilation_cache/compile_requests_use_cache": "cache_requests"}
_DURATIONS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
              "/jax/core/compile/backend_compile_duration": "backend_compile_s",
              "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read_s"}


def _device_check():
    """The device check script beside this one (``scripts/device_check.py``), imported once
    as the module ``device_check_script``."""
    import importlib.util

    name = "device_check_script"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().with_name("device_check.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: its dataclasses look it up
        spec.loader.exec_module(module)
    return sys.modules[name]


def _model(name: str):
    """``(LoadedModel, device_check shape)``: the real weights, or ``random-<shape>``."""
    import jax.numpy as jnp

    device_check = _device_check()
    if name.startswith("random-"):
        key = name[len("random-"):]
        shapes = {**device_check._shapes(False), **device_check._shapes(True)}
        shape = dict(shapes[key])
        return device_check.random_model(key, shape), shape
    from specjax.models import load

    lm = load(name, dtype=jnp.float32)
    return lm, dict(family=lm.model.config.__class__.__name__.replace("Config", "").lower(),
                    cfg=lm.model.config, dtype=jnp.float32, compute=jnp.float32)


def child(a) -> None:
    """One pass: every method once, one JSON line per method on stdout."""
    import jax
    import numpy as np

    import specjax
    from specjax import _cache

    device_check = _device_check()

    counts: dict[str, int] = {}
    secs: dict[str, float] = {}

    def on_event(event: str, **kw) -> None:
        if event in _EVENTS:
            counts[_EVENTS[event]] = counts.get(_EVENTS[event], 0) + 1

    def on_duration(event: str, duration: float, **kw) -> None:
        if event in _DURATIONS:
            secs[_DURATIONS[event]] = secs.get(_DURATIONS[event], 0.0) + duration

    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    t = time.perf_counter()
    lm, shape = _model(a.model)
    print(json.dumps({"load_s": round(time.perf_counter() - t, 2),
                      "cache_dir": "a temporary directory" if _cache.directory() else None,
                      "cache_on": _cache.enabled(),
                      "specjax": specjax.__version__}), flush=True)
    settings = device_check.method_settings(lm, a.max_new_tokens)
    layers = device_check.exit_layer(shape)
    ids = np.random.default_rng(0).integers(3, lm.model.config.vocab_size,
                                            a.prompt_len).tolist()
    cache_dir = _cache.directory()
    for method in a.methods.split(";"):
        counts.clear()
        secs.clear()
        before = _dir_size(cache_dir)[1]
        t, cpu = time.perf_counter(), time.process_time()
        run, label = device_check._runner(lm, settings, method, layers)
        r = run(ids, a.max_new_tokens)
        print(json.dumps({"method": method, "spec": label, "compile_s": round(r.compile_s, 3),
                          "first_call_s": round(time.perf_counter() - t, 3),
                          "first_call_cpu_s": round(time.process_time() - cpu, 3),
                          "bytes_written": _dir_size(cache_dir)[1] - before,
                          **{v: counts.get(v, 0) for v in _EVENTS.values()},
                          **{v: round(secs.get(v, 0.0), 3) for v in _DURATIONS.values()}}),
              flush=True)


def _pass(a, cache: str, label: str) -> dict:
    env = dict(os.environ, SPECJAX_CACHE=cache)
    for k in ("JAX_COMPILATION_CACHE_DIR", "SPECJAX_COMPILATION_CACHE"):
        env.pop(k, None)
    cmd = [sys.executable, __file__, "--child", "--model", a.model, "--methods",
           ";".join(a.method_list), "--max-new-tokens", str(a.max_new_tokens),
           "--prompt-len", str(a.prompt_len)]
    t = time.perf_counter()
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{label} pass failed:\n{out.stderr[-4000:]}")
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    head, rows = lines[0], lines[1:]
    print(f"[{label}] process {time.perf_counter() - t:.1f} s, load {head['load_s']} s",
          file=sys.stderr, flush=True)
    for r in rows:
        print(f"[{label}] {r['method']:<14} compile {r['compile_s']:7.2f} s  first call "
              f"{r['first_call_s']:7.2f} s  hits {r['cache_hits']}  writes "
              f"{r['cache_writes']}  (trace {r['trace_s']:.2f}, lower {r['lower_s']:.2f}, "
              f"backend {r['backend_compile_s']:.2f}, of which cache read "
              f"{r['cache_read_s']:.2f})", file=sys.stderr, flush=True)
    return {"process_s": round(time.perf_counter() - t, 2), **head,
            "methods": {r.pop("method"): r for r in rows}}


def _dir_size(path: Path) -> tuple[int, int]:
    """``(files, bytes)`` under ``path`` (none when it does not exist)."""
    files = [p for p in path.rglob("*") if p.is_file()] if path.exists() else []
    return len(files), sum(p.stat().st_size for p in files)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m",
                   help="a registry name (real weights) or random-<device_check shape>, "
                        "e.g. random-smollm2-135m, random-tiny-llama")
    p.add_argument("--methods", help="methods separated by ';' (default: "
                                     "scripts/device_check.py's ALL_METHODS)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--note", default="", help="recorded as is (e.g. that the machine was "
                                              "shared)")
    p.add_argument("--out", help="the JSON report (default: print only)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a)
    from specjax import bench

    a.method_list = a.methods.split(";") if a.methods else list(_device_check().ALL_METHODS)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="specjax-cc-") as cache:
        first = _pass(a, cache, "first")
        entries, nbytes = _dir_size(Path(cache) / "jax")
        second = _pass(a, cache, "second")
    load_after = os.getloadavg()
    rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    table = {m: {"first_compile_s": first["methods"][m]["compile_s"],
                 "second_compile_s": second["methods"][m]["compile_s"],
                 "first_call_first_s": first["methods"][m]["first_call_s"],
                 "first_call_second_s": second["methods"][m]["first_call_s"],
                 "second_cache_hits": second["methods"][m]["cache_hits"],
                 "second_cache_writes": second["methods"][m]["cache_writes"],
                 "first_bytes_written": first["methods"][m]["bytes_written"]}
             for m in a.method_list}
    report = {"command": shlex.join([".venv/bin/python", "scripts/compile_cache.py",
                                     *sys.argv[1:]]),
              "note": a.note,
              "loadavg_before_after": [load_before, load_after],
              "git_head": rev, "git_dirty": bool(subprocess.run(
                  ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                  capture_output=True, text=True).stdout.strip()), "machine": bench.machine_info(), "model": a.model,
              "max_new_tokens": a.max_new_tokens, "prompt_len": a.prompt_len,
              "notes": {
                  "compile_s": "lowering plus XLA compilation (or the persistent cache's "
                               "read) of the method's decode program, as specjax bench "
                               "reports it",
                  "first_call_s": "the method's build and its whole first decode call, "
                                  "every small jit around the decode program included; "
                                  "first_call_cpu_s: the process's CPU seconds over the "
                                  "same span (all threads)",
                  "trace_s/lower_s/backend_compile_s/cache_read_s": "jax.monitoring "
                      "durations summed over the method's first call: tracing to a jaxpr, "
                      "lowering to StableHLO, XLA compilation or the persistent cache's "
                      "read (the read is part of backend_compile_s)",
                  "order": "methods ran in this order in one process per pass, so a "
                           "first-pass method may read a program an earlier one wrote"},
              "cache_after_first": {"entries": entries, "bytes": nbytes},
              "table": table, "first": first, "second": second}
    print(f"{'method':<14} {'first s':>8} {'second s':>9}")
    for m, r in table.items():
        print(f"{m:<14} {r['first_compile_s']:8.2f} {r['second_compile_s']:9.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
