"""One prepared check of a GPU or TPU host: every figure the CPU cannot give, in one run
that fits a few minutes of accelerator time, offline, on random weights of real shapes.

    bash scripts/device_check.sh                          # on the accelerator host
    bash scripts/device_check.sh --small --out /tmp/dc    # the same code path on a CPU
    python scripts/device_check.py --small --out /tmp/dc  # the same, with this interpreter's
                                                          # specjax as it is installed

For each model shape (SmolLM2-135M, Llama-3.1-8B, Gemma-3-270M, Gemma-4-E4B, Gemma-4-31B;
tiny ones of each family with ``--small``) it measures, in priority order and within a time
budget per phase:

* the width curve: one target forward over ``W`` new tokens with ~800 cached, against
  ``W = 1``;
* ``ar`` end to end, and against the device's memory-bandwidth bound
  (``specjax.bench.bandwidth_probe``: a copy in device memory on a GPU/TPU);
* transformers' greedy ``generate`` on the same device, same shape and prompts (a random
  model built from the config with torch; its weights are not ours, so only speed compares);
* every method end to end (``sd-ngram``, EAGLE-2 and ReDrafter with random heads, HSD,
  ...: each registered method's ``Method.device`` specs, where it drafts for the shape's
  family, e.g. ``mtp`` with a random assistant on Gemma 4 only), its greedy output against
  ``ar``'s, its compile time, its time per round against an ``ar`` step;
* a kernel-count proxy of a round's cost from the compiled programs (``specjax.hlo.hlo_stats``):
  kernels (fusions, library calls, unfused ops) per decoding round against a target
  forward's, loops and conditionals per round, and host transfers (infeed/outfeed,
  send/recv, host callbacks), which must be none inside the decoding loop.

Results go to ``OUT/device_check_<device>.json`` (``h100``, ``cpu``, ...) and a plot beside
it. While the run goes on, the JSON is rewritten after every measurement in the staging
directory ``OUT/.device_check_<device>.tmp-PID``; at the end (also when a hard time limit
interrupts it with SIGINT) the JSON and plot replace the previous run's pair as one
(``specjax._atomic.replace_files``), so a run killed outright leaves the previous results
whole, and the next run names and removes its staging directory. The options are checked
before any weights are made: ``--methods`` must name methods a chosen shape lists (one that
some chosen shapes do not list is recorded as skipped for them: not ``complete``).
Methods are built as ``specjax bench`` builds them (``specjax.methods``; EAGLE and
ReDrafter with random heads, since no trained head fits a random target), from plain
settings (``Settings``, ``MethodSettings``), not from a command line.

A tool, not part of the package (it was the module ``specjax.device_check``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specjax import _atomic
from specjax.hlo import hlo_stats
from specjax.jax_setup import setup_jax

setup_jax()  # before JAX picks a backend: as the specjax commands run


# --------------------------------------------------------------------------- shapes

def _shapes(small: bool) -> dict[str, dict]:
    """Model shapes to check: name -> config, storage and product dtypes, the methods it
    runs (``all``: every method drafting for its family, ``_all_methods``), whether
    transformers runs beside (``hf``), the batched phase's methods and at most how many
    programs compile at once (``workers``, else ``--workers``). A shape's family is its
    config's registered one (``_family``)."""
    import jax.numpy as jnp

    from specjax.models import gemma, gemma4, llama

    f32, bf16 = jnp.float32, jnp.bfloat16
    if small:
        tl = llama.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                               num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                               max_position_embeddings=1024)
        tg = gemma.GemmaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                               num_layers=4, num_heads=2, num_kv_heads=1, head_dim=32,
                               layer_types=gemma.gemma3_layer_types(4, pattern=2),
                               sliding_window=32, query_pre_attn_scalar=32.0,
                               max_position_embeddings=1024)
        # tests/toys.py's GEMMA4 at 512 tokens: sliding and full layers of their own
        # geometry (K as V on the full ones), the last two sharing the first two's keys and
        # values (double-wide MLPs), per-layer embeddings, a window the prompts pass
        tg4 = gemma4.Gemma4Config(
            vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
            num_kv_heads=2, head_dim=16, layer_types=("sliding", "full", "sliding", "full"),
            global_head_dim=32, num_global_kv_heads=1, attention_k_eq_v=True,
            sliding_window=32, partial_rotary_factor=0.25, final_logit_softcapping=30.0,
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=512,
            num_kv_shared_layers=2, use_double_wide_mlp=True, max_position_embeddings=1024)
        return {"tiny-llama": dict(cfg=tl, dtype=f32, compute=f32, methods="all", hf=True,
                                   batched="ar,eagle3:2,2,3,sd-ngram:7"),
                "tiny-gemma": dict(cfg=tg, dtype=f32, compute=f32, methods="all", hf=True),
                "tiny-gemma4": dict(cfg=tg4, dtype=f32, compute=f32, methods="all",
                                    hf=True)}
    llama31_8b = llama.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=llama.RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), rms_norm_eps=1e-5,
        tie_embeddings=False, max_position_embeddings=131072)
    # Gemma 4: ar and the methods drafting for Gemma 4 alone (``mtp``, with a random
    # assistant of the published sizes for the target's width: ``MTP.random``)
    gemma4_methods = ",".join(["ar", *_family_methods("Gemma4")])
    return {
        # float32 as the CPU benchmarks; products at "highest" precision (no TF32)
        "smollm2-135m": dict(cfg=llama.SMOLLM2_135M, dtype=f32, compute=f32, methods="all",
                             hf=True),
        # bfloat16 storage and bfloat16 products: the usual accelerator recipe, a timing
        # (README "bfloat16": greedy output can then leave ar's on near-ties)
        # an EAGLE-3 head of the published Llama-3.1-8B head's shapes (fc [4096, 3 x 4096],
        # a 32000-token draft vocabulary), random: what a user's speedup is made of
        "llama3.1-8b": dict(cfg=llama31_8b, dtype=bf16, compute=bf16,
                            methods="ar,sd-ngram:7,eagle2:3,4,7,eagle3:3,4,7,eagle3:7,10,60",
                            hf=True, batched="ar,eagle3:3,4,7,sd-ngram:7"),
        "gemma3-270m": dict(cfg=gemma.GEMMA3_270M, dtype=f32, compute=f32, methods="all",
                            hf=True),
        # 14.9 GB of bfloat16 weights (5.6 GB of them per-layer embeddings); transformers'
        # random model of the same shape beside it fits an 80 GB card
        "gemma4-e4b": dict(cfg=gemma4.GEMMA4_E4B, dtype=bf16, compute=bf16,
                           methods=gemma4_methods, hf=True),
        # 61.4 GB (57.2 GiB) of bfloat16 weights: on an 80 GB H100 only above JAX's
        # default cap of 75% of the device's memory (run_check raises it to 95%: the
        # weights, a 0.9 GB assistant, the caches of a few hundred tokens and the scratch
        # of 4 concurrent compiles, each autotuning the logits' product with a 2.8 GB copy
        # of the embedding, by estimate, not yet run on one); an H200 holds it at the
        # default. Last, so that no transformers peer of an earlier shape finds JAX's pool
        # grown to it. No transformers peer: a second random copy in torch (another 61 GB)
        # does not fit beside ours on an 80 GB card
        "gemma4-31b": dict(cfg=gemma4.GEMMA4_31B, dtype=bf16, compute=bf16,
                           methods=gemma4_methods, hf=False, workers=4),
    }


def _family(shape: dict) -> str:
    """The registered model family of ``shape``'s config (``Llama``, ``Gemma``,
    ``Gemma4``, ...: ``specjax.models.families``)."""
    from specjax.models import families, loading  # noqa: F401 -- loading registers them

    return families.family(shape["cfg"])


def _decoders() -> tuple[type, ...]:
    """The registered decoding method classes (no benchmark peers), in registration order."""
    from specjax import methods

    return tuple(cls for cls in methods.registered() if cls.decodes)


def _family_methods(family: str) -> tuple[str, ...]:
    """The ``Method.device`` specs of the methods drafting for ``family`` alone
    (``Method.family``), in registration order."""
    return tuple(t for cls in _decoders() if cls.family == family for t in cls.device)


def _all_methods(family: str | None = None) -> tuple[str, ...]:
    """A shape's ``all``: the ``Method.device`` specs of every registered method that
    drafts for ``family`` (those for any family, ``Method.family`` None, and those for
    ``family`` alone), in registration order; ``family`` None: those for any family."""
    return tuple(t for cls in _decoders() if cls.family in (None, family) for t in cls.device)


#: the methods drafting for any family (each shape's ``all`` adds its family's own)
ALL_METHODS = _all_methods()
#: every registered method's device specs: the order the report and plot list them in
METHOD_ORDER = tuple(t for cls in _decoders() for t in cls.device)


def random_model(name: str, shape: dict, seed: int = 0, scale: float = 1.0,
                 scan_layers: bool = False):
    """A ``LoadedModel`` of random weights in ``shape``, made on JAX's default device (no
    file, no tokenizer, no EOS: every decode runs to its budget). ``scan_layers``: a Llama
    runs its layers under one ``lax.scan`` over stacked weights (as ``load`` makes it)."""
    import importlib

    import jax

    from specjax.models import families, llama, loading
    from specjax.models.registry import LoadedModel

    # the family's model module (``specjax.models.llama``, ``gemma``, ``gemma4``, ...) draws
    # them, leaf by leaf in the storage dtype: no float32 copy of the whole tree
    module = importlib.import_module(families.family_of(shape["cfg"]).model().__module__)
    params = module.init_params(shape["cfg"], jax.random.key(seed), shape["dtype"])
    if scale != 1.0:  # sharper logits: no near-ties between widths on tiny models
        params = jax.tree.map(lambda x: (x * scale).astype(x.dtype), params)
    jax.block_until_ready(params)
    model = loading.model_for(shape["cfg"], shape["compute"])
    if scan_layers:
        model, params = dataclasses.replace(model, scan_layers=True), llama.stack_layers(params)
    return LoadedModel(name=f"random-{name}", model=model, params=params, tokenizer=None,
                       eos_ids=(), source=Path(f"random-{name}"))


def hf_config(shape: dict):
    """transformers' config of ``shape``'s model (no BOS/EOS/pad ids: every generate runs to
    its budget), by its family."""
    import transformers

    cfg, fam = shape["cfg"], _family(shape)
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                  intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                  head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                  rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_embeddings,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    types = ["full_attention" if t == "full" else "sliding_attention"
             for t in getattr(cfg, "layer_types", ())]
    if fam == "Gemma4":  # per-layer-type RoPE and geometry (transformers' Gemma4TextConfig)
        rope = {"full_attention": {"rope_type": "proportional", "rope_theta": cfg.rope_theta,
                                   "partial_rotary_factor": cfg.partial_rotary_factor},
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": cfg.rope_local_theta}}
        moe = dict(enable_moe_block=True, num_experts=cfg.num_experts,
                   top_k_experts=cfg.top_k_experts,
                   moe_intermediate_size=cfg.moe_intermediate_size) if cfg.num_experts else {}
        return transformers.Gemma4TextConfig(
            **common, layer_types=types, sliding_window=cfg.sliding_window,
            rope_parameters=rope, global_head_dim=cfg.global_head_dim or cfg.head_dim,
            num_global_key_value_heads=cfg.num_global_kv_heads,
            attention_k_eq_v=cfg.attention_k_eq_v,
            final_logit_softcapping=cfg.final_logit_softcapping,
            hidden_size_per_layer_input=cfg.hidden_size_per_layer_input,
            vocab_size_per_layer_input=cfg.vocab_size_per_layer_input,
            num_kv_shared_layers=cfg.num_kv_shared_layers,
            use_double_wide_mlp=cfg.use_double_wide_mlp, **moe)
    rs = cfg.rope_scaling
    rope = {"rope_type": rs.rope_type, "rope_theta": cfg.rope_theta}
    if rs.rope_type == "llama3":
        rope.update(factor=rs.factor, low_freq_factor=rs.low_freq_factor,
                    high_freq_factor=rs.high_freq_factor,
                    original_max_position_embeddings=rs.original_max_position_embeddings)
    if fam == "Llama":
        return transformers.LlamaConfig(**common, rope_parameters=rope)
    if fam == "Gemma":
        return transformers.Gemma3TextConfig(
            **common, layer_types=types, sliding_window=cfg.sliding_window,
            query_pre_attn_scalar=int(cfg.query_pre_attn_scalar))
    raise ValueError(f"no transformers peer for the {fam} family here")


def hf_random_model(shape: dict):
    """transformers' model of the same shape (``hf_config``), random weights, on the torch
    device in the storage dtype."""
    import torch
    import transformers

    from specjax import bench

    tc = hf_config(shape)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[np.dtype(shape["dtype"]).name]
    with torch.device(bench._torch_device()):
        try:
            model = transformers.AutoModelForCausalLM.from_config(tc, dtype=dtype)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            model = transformers.AutoModelForCausalLM.from_config(tc, torch_dtype=dtype)
    return model.eval()


# --------------------------------------------------------------------------- the run

class Budget:
    """A global deadline and one per phase; ``left()`` is the smaller remainder."""

    def __init__(self, total: float):
        self.t0 = time.perf_counter()
        self.end = self.t0 + total
        self.phase_end = self.end

    def phase(self, seconds: float) -> None:
        self.phase_end = min(self.end, time.perf_counter() + seconds)

    def left(self) -> float:
        return _agreed(min(self.end, self.phase_end) - time.perf_counter())

    def remaining(self) -> float:
        """Of the whole run."""
        return _agreed(self.end - time.perf_counter())

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def _agreed(seconds: float) -> float:
    """``seconds`` as process 0 measured them, in a multi-process run: every process
    checks its budget at the same points, so all of them take the same decisions."""
    import jax

    if jax.process_count() == 1:
        return seconds
    from jax.experimental import multihost_utils

    return float(multihost_utils.broadcast_one_to_all(np.float32(seconds)))


class Report:
    """The results JSON, rewritten after every measurement."""

    def __init__(self, path: Path, data: dict):
        self.path, self.data = path, data
        self.save()

    def save(self) -> None:
        from specjax import bench

        bench.write_json(self.path, self.data)
        _atomic.kill_point("device-check-saved")  # a test hook: a kill mid-run


def _log(msg: str) -> None:
    print(f"[device_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _executables() -> dict[int, object]:
    """Every executable the host wrappers compiled so far (``specjax._compile``)."""
    from specjax import _compile

    return {id(e): e for c in list(_compile._CACHES) for e in c._exes.values()}


def _forward_fn(model):
    """One target forward over ``W`` new tokens as a chain (what a verification of a
    ``W - 1``-token draft computes), logits included."""
    from specjax.core import tree

    def fwd(params, toks, cache):
        parents = tree.chain(1, toks.shape[1] - 1)
        logits, _, c = model.forward(params, toks, tree.positions(cache.length, parents),
                                     cache, tree.attention_mask(parents))
        return logits, c.length
    return fwd


def width_programs(lm, widths, capacity: int, filled: int) -> tuple:
    """``(cache, {W: compile job})``: the cache with ``filled`` tokens and, per width, a
    zero-argument function compiling one forward over ``W`` new tokens (for ``prepare``)."""
    import jax
    import jax.numpy as jnp

    cache = lm.model.init_cache(1, capacity).replace(length=jnp.asarray([filled], jnp.int32))
    fwd = jax.jit(_forward_fn(lm.model))

    def job(w):
        t = time.perf_counter()
        exe = fwd.lower(lm.params, jnp.ones((1, w), jnp.int32), cache).compile()
        return exe, time.perf_counter() - t

    return cache, {w: (lambda w=w: job(w)) for w in widths}


def width_curve(lm, futures: dict, cache, capacity: int, repeats: int, budget: Budget,
                out: dict, save) -> None:
    """ms of one forward over each width with the cache's tokens cached (median of
    ``repeats``), from the programs ``futures`` compile (``width_programs``, run by
    ``prepare``); the 1-token forward's program gives ``kernels_forward``."""
    import jax
    import jax.numpy as jnp

    out.update(capacity=capacity, filled=int(cache.length[0]), ms={}, compile_s={},
               relative_to_1={})
    for w, fut in sorted(futures.items()):
        got = _wait(fut, budget)
        if got is None:
            out.setdefault("skipped", []).append(w)
            continue
        exe, out["compile_s"][w] = got
        if w == 1:
            out["kernels_forward"] = hlo_stats(exe.as_text())["program"]
        toks = jnp.ones((1, w), jnp.int32)
        jax.block_until_ready(exe(lm.params, toks, cache))
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(exe(lm.params, toks, cache))
            times.append(time.perf_counter() - t)
        out["ms"][w] = 1e3 * float(np.median(times))
        if 1 in out["ms"]:
            out["relative_to_1"] = {k: v / out["ms"][1] for k, v in out["ms"].items()}
        _log(f"  width {w:>2}: {out['ms'][w]:.3f} ms (compile {out['compile_s'][w]:.1f} s)")
        save()


@dataclasses.dataclass(frozen=True)
class MethodSettings:
    """What building and running a method reads, as ``specjax bench`` names them: new
    tokens per prompt, the verification-width policy (``--verify-widths``) and whether a
    Llama runs its layers under one scan (``--scan-layers``; recorded, the model carries it)."""

    max_new_tokens: int = 128
    verify_widths: str = "auto"
    scan_layers: bool = False


def method_settings(lm, max_new_tokens: int, verify_widths: str = "auto") -> MethodSettings:
    """The ``MethodSettings`` of runs on ``lm``: its layer layout as it was built."""
    return MethodSettings(max_new_tokens, verify_widths,
                          bool(getattr(lm.model, "scan_layers", False)))


def exit_layer(shape: dict) -> int:
    """The exit layer of ``hsd``'s early-exit drafter on ``shape``: 2/5 of the way up, at
    least 1."""
    return max(1, shape["cfg"].num_layers * 2 // 5)


def _built(lm, settings: MethodSettings, method: str, layers: int, seed: int = 1):
    """The ``methods.Built`` ``specjax bench`` would run, with random heads where a method
    reads one (its class's ``random``: no trained head fits random targets); ``hsd`` as
    an n-gram, an early exit at ``layers`` and the target."""
    import jax

    from specjax import methods

    spec = methods.parse(method if method != "hsd" else f"hsd:ngram:4,{layers}:3,target")
    opts = methods.Options(widths=settings.verify_widths, layers=(layers,))
    return spec.random(lm, opts, jax.random.key(seed))


#: methods built and compiled ahead (``prepare``), by (model id, method, batch)
_PREPARED: dict = {}


@dataclasses.dataclass
class Prepared:
    """One method's program, built and compiled (by a warm-up decode) ahead of its timing."""

    built: object
    compile_s: float  # as measured inside a pool of concurrent compiles
    exe_texts: list
    error: str | None = None


def _runner(lm, settings: MethodSettings, method: str, layers: int, seed: int = 1):
    """``(bench Method, method as run)``: the prepared method when ``prepare`` built it,
    else built now (``_built``)."""
    from specjax import bench

    prep = _PREPARED.get((id(lm), method, 1))
    if prep is not None and prep.error:
        raise RuntimeError(f"while compiling: {prep.error}")
    built = prep.built if prep is not None else _built(lm, settings, method, layers, seed)
    return bench.decoder_method(lm, built), built.name


def _prepared_exes(lm, method: str, new: list) -> tuple[list, float]:
    """The compiled programs and compile seconds of a method ``prepare`` compiled (a
    timing run after it compiles nothing new), else ``(new, 0.0)``."""
    prep = _PREPARED.get((id(lm), method, 1))
    if prep is None or new:
        return new, 0.0
    return [_Text(t) for t in prep.exe_texts], prep.compile_s


@dataclasses.dataclass
class _Text:
    text: str

    def as_text(self) -> str:
        return self.text


def _exes_of(decoder) -> list:
    """Every compiled program of ``decoder`` in the host wrappers' caches."""
    from specjax import _compile

    return [e for c in list(_compile._CACHES) for k, e in list(c._exes.items())
            if any(v is decoder for _, v in k[0])]


def _warm(lm, settings: MethodSettings, method: str, layers: int, ids: list[int],
          batch: int) -> Prepared:
    """Builds ``method`` and decodes ``batch`` copies of ``ids`` once (its compile)."""
    import jax

    from specjax import bench

    try:
        built = _built(lm, settings, method, layers)
        out = built([ids] * batch, max_new_tokens=settings.max_new_tokens, eos_ids=lm.eos_ids,
                    **bench._sampling_kw(None))
        jax.block_until_ready(out.tokens)
        return Prepared(built, float(out.compile_s),
                        [e.as_text() for e in _exes_of(built.decoder)])
    except Exception as e:  # noqa: BLE001 -- recorded as the method's result
        traceback.print_exc()
        return Prepared(None, 0.0, [], f"{type(e).__name__}: {str(e)[:400]}")


def prepare(lm, settings: MethodSettings, layers: int, ids: list[int], jobs: list[tuple[str, int]],
            extra: dict, workers: int) -> dict:
    """Compiles every ``(method, batch)`` of ``jobs``, and every ``extra`` job (a name and
    a zero-argument function), in a pool of ``workers`` threads: XLA compiles outside the
    GIL, so a host with many cores compiles a shape's programs at once. ``workers=0``:
    one after another in this thread (a mesh over processes, where every process must run
    its programs in one order). Returns the futures by job; each method's ``Prepared``
    also goes to ``_PREPARED``."""
    import concurrent.futures as cf

    def job(m, b):
        prep = _warm(lm, settings, m, layers, ids, b)
        _PREPARED[(id(lm), m, b)] = prep
        return prep

    if workers == 0:
        return {**{k: _done(fn) for k, fn in extra.items()},
                **{(m, b): _done(lambda m=m, b=b: job(m, b)) for m, b in jobs}}
    pool = cf.ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="compile")

    futures = {k: pool.submit(fn) for k, fn in extra.items()}  # the first timed
    futures.update({(m, b): pool.submit(job, m, b) for m, b in jobs})
    pool.shutdown(wait=False)
    return futures


def _done(fn):
    """A future already holding ``fn()``."""
    import concurrent.futures as cf

    f = cf.Future()
    f.set_result(fn())
    return f


def _wait(future, budget: "Budget"):
    """The future's result, or None when the budget ends first."""
    import concurrent.futures as cf

    try:
        return future.result(timeout=max(budget.left(), 0.0))
    except cf.TimeoutError:
        return None


def _settings_of(settings: MethodSettings) -> dict:
    """The verification-width policy and the layer layout the methods ran with."""
    return {"verify_widths": settings.verify_widths, "scan_layers": settings.scan_layers}


def run_methods(lm, questions, settings: MethodSettings, layers: int, methods,
                budget: Budget, out: dict, ref: dict, save, defer: list | None = None) -> None:
    """Every method end to end on ``questions``: tokens against ``ar``'s (kept in ``ref``,
    ``ar`` first), compile time, time per round against an ``ar`` step, kernels per
    round. Where a method's tokens leave ``ar``'s, the first divergence per prompt is
    classified (``specjax.divergence``): ``divergence`` holds the counts of prompts
    ``equal`` / ``near_tie`` / ``mismatch`` and the records, ``real_mismatches`` the
    mismatch count (None where it could not be classified). With ``defer`` (a list), the
    classification is appended there as ``(method, function, out)`` instead, to run after every
    timing (``classify_deferred``): its programs compile then, not between timings."""
    for m in methods:
        if budget.left() <= 0:
            out.setdefault("skipped", []).append(m)
            continue
        try:
            before = _executables()
            run, label = _runner(lm, settings, m, layers)
            runs = [run(list(q.ids), settings.max_new_tokens) for q in questions]
        except Exception as e:  # noqa: BLE001 -- one method's failure is a result too
            out[m] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            _log(f"  {m}: FAILED {out[m]['error']}")
            traceback.print_exc()
            save()
            continue
        new = [e for k, e in _executables().items() if k not in before]
        new, pre_s = _prepared_exes(lm, m, new)  # compiled ahead by ``prepare``
        toks = sum(len(r.tokens) for r in runs)
        secs = sum(r.seconds for r in runs)
        rounds = sum(r.target_forwards for r in runs)
        rec = {"spec": label, "n_prompts": len(runs), "new_tokens": toks,
               "tokens_per_s": toks / secs,
               "compile_s": sum(r.compile_s for r in runs) + pre_s,
               "target_forwards": rounds, "tau": toks / rounds,
               "ms_per_round": 1e3 * secs / rounds}
        if m == "ar":
            ref.update(tokens=[r.tokens for r in runs], step_ms=1e3 * secs / toks,
                       tokens_per_s=toks / secs)
        if "tokens" in ref:
            rec["equal_to_ar"] = [r.tokens for r in runs] == ref["tokens"]
            rec["prompts_equal_to_ar"] = sum(r.tokens == a for r, a in zip(runs, ref["tokens"]))
            rec["round_vs_ar_step"] = rec["ms_per_round"] / ref["step_ms"]
            rec["speedup_vs_ar"] = rec["tokens_per_s"] / ref["tokens_per_s"]
            dec = getattr(getattr(run, "built", None), "decoder", None)
            job = functools.partial(_classify, lm, questions, [r.tokens for r in runs],
                                    ref["tokens"], dec, settings.max_new_tokens, rec)
            if defer is not None and not rec["equal_to_ar"]:
                defer.append((m, job, out))
            else:  # equal outputs cost nothing
                job()
        if new:  # the method's decode program (its largest new one): kernels per round
            stats = hlo_stats(max((e.as_text() for e in new), key=len))
            rec["kernels"] = stats
            rec["kernels_per_round"] = (stats["round"] or {}).get("kernels")
            rec["host_transfers_in_loop"] = (stats["round"] or {}).get("host_transfers")
            if rec["kernels_per_round"] and ref.get("kernels_forward"):
                rec["kernels_round_vs_forward"] = rec["kernels_per_round"] / ref["kernels_forward"]
        out[m] = rec
        _log(f"  {m:<14} {rec['tokens_per_s']:8.1f} tok/s  tau {rec['tau']:.2f}  "
             f"{rec['ms_per_round']:.2f} ms/round ({rec.get('round_vs_ar_step', 1):.2f}x ar "
             f"step)  compile {rec['compile_s']:.1f} s  equal to ar: "
             f"{rec.get('equal_to_ar')}  kernels/round {rec.get('kernels_per_round')}")
        _log_divergence(rec)
        save()


def _classify(lm, questions, tokens, ar_tokens, dec, max_new: int, rec: dict) -> None:
    """``rec["divergence"]`` and ``rec["real_mismatches"]`` (``specjax.divergence``): only
    diverging prompts cost anything, a prefill and ``W + 1`` forwards each."""
    from specjax import divergence

    try:
        w = divergence.verification_width(dec)
        cap = max(len(q.ids) for q in questions) + max_new + w
        rec["divergence"] = divergence.report([
            (i, None if t == a else divergence.classify(
                lm, list(q.ids), a, t, w, chunk=dec.chunk, capacity=cap))
            for i, (q, t, a) in enumerate(zip(questions, tokens, ar_tokens))])
        rec["real_mismatches"] = rec["divergence"]["mismatch"]
    except Exception as e:  # noqa: BLE001 -- the timings stand; say what failed
        rec["divergence"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        rec["real_mismatches"] = None


def _log_divergence(rec: dict) -> None:
    from specjax import divergence

    for d in (rec.get("divergence") or {}).get("records", []):
        _log(f"    prompt {d['prompt']}: {d['kind']} at "
             f"{divergence.Divergence.from_dict(d).line()}")


def classify_deferred(defer: list, budget: Budget, save) -> None:
    """Runs the classifications ``run_methods`` and ``run_batched`` deferred (``(method,
    function, its records)``), while the budget lasts; a method
    left unclassified gets ``divergence: {"skipped": ...}`` (the run is then incomplete)."""
    for m, job, out in defer:
        if budget.left() <= 0:
            out[m]["divergence"] = {"skipped": "out of time"}
            out[m]["real_mismatches"] = None
            continue
        t = time.perf_counter()
        job()
        out[m]["divergence_s"] = time.perf_counter() - t
        _log(f"  {m}: greedy divergence from ar classified in {out[m]['divergence_s']:.1f} s")
        _log_divergence(out[m])
        save()


def run_hf(lm, shape: dict, questions, n_new: int, out: dict, save) -> None:
    """transformers' greedy ``generate`` (random weights of the same shape, same device)."""
    from specjax import bench

    t = time.perf_counter()
    hf = None
    try:
        hf = hf_random_model(shape)
        build_s = time.perf_counter() - t
        run = bench.hf_method(lm, os.cpu_count() or 1, hf=hf)
        runs = [run(list(q.ids), n_new) for q in questions]
        toks = sum(len(r.tokens) for r in runs)
        secs = sum(r.seconds for r in runs)
        out.update(tokens_per_s=toks / secs, new_tokens=toks, ms_per_token=1e3 * secs / toks,
                   build_s=build_s, device=bench._torch_device(), same_weights=False,
                   dtype=str(next(hf.parameters()).dtype))
        _log(f"  hf (transformers) {out['tokens_per_s']:.1f} tok/s")
    finally:  # the device memory goes back to JAX's next shape either way
        del hf
        _free_torch()
    save()


def _hf_on_another_device() -> bool:
    """True where transformers would run on the host CPU while JAX decodes on an
    accelerator (a TPU host, or torch without CUDA): no peer on the same device."""
    try:
        from specjax import bench

        return bench.device_info()["platform"] != "cpu" and bench._torch_device() == "cpu"
    except ImportError:  # no torch: no peer
        return True


def _free_torch() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def check_shape(name: str, shape: dict, opts, budget: Budget, probe: dict, out: dict,
                save) -> None:
    """``_check_shape`` at ``--precision`` for float32 products (no TF32 or bfloat16 passes:
    the lossless setting); bfloat16 products at JAX's default."""
    import contextlib

    import jax

    f32 = np.dtype(shape["compute"]) == np.float32 and opts.precision != "default"
    out["matmul_precision"] = opts.precision if f32 else "default"
    with jax.default_matmul_precision(opts.precision) if f32 else contextlib.nullcontext():
        _check_shape(name, shape, opts, budget, probe, out, save)


def _check_shape(name: str, shape: dict, opts, budget: Budget, probe: dict, out: dict,
                 save) -> None:
    """Everything measured on one model shape, in priority order, within the phase's time:
    the width curve (a third of it at most), ``ar`` and its bound, transformers, then the
    other methods."""
    import jax

    from specjax import _compile, bench

    cfg = shape["cfg"]
    out.update(config=dataclasses.asdict(cfg), dtype=np.dtype(shape["dtype"]).name,
               compute_dtype=np.dtype(shape["compute"]).name)
    if not_listed(shape, opts):
        out["not_listed"] = not_listed(shape, opts)
    t = time.perf_counter()
    out["family"] = _family(shape)
    scan = opts.scan_layers and out["family"] == "Llama"  # Gemma, Gemma 4 stay unrolled
    lm = random_model(name, shape, scale=3.0 if opts.small else 1.0, scan_layers=scan)
    if opts.mesh:  # every process made the same weights from one key: each places its slices
        from specjax import sharding

        lm = lm.on_mesh(sharding.mesh_from_spec(opts.mesh))
        out["mesh"] = opts.mesh
    out["init_s"] = time.perf_counter() - t
    out["weight_bytes"] = int(sum(x.nbytes for x in jax.tree.leaves(lm.params)))
    _log(f"{name}: {out['weight_bytes'] / 1e6:.0f} MB of random weights in "
         f"{out['init_s']:.1f} s")
    save()
    questions = bench.random_questions(opts.prompts, opts.prompt_len, cfg.vocab_size)
    settings = method_settings(lm, opts.max_new_tokens, opts.verify_widths)
    layers = exit_layer(shape)
    out["settings"] = {"prompts": opts.prompts, "prompt_len": opts.prompt_len,
                       "max_new_tokens": opts.max_new_tokens, **_settings_of(settings)}
    methods = _methods_of(shape, opts, "methods")
    batched = _methods_of(shape, opts, "batched") if opts.batch > 1 and not opts.mesh else []
    widths = [] if opts.mesh else [int(w) for w in opts.widths.split(",")]
    cache, wjobs = width_programs(lm, widths, opts.capacity, opts.filled)
    t = time.perf_counter()
    # on a mesh over processes, every process runs its programs in one order: no threads
    workers = min(opts.workers, shape.get("workers", opts.workers))
    futs = prepare(lm, settings, layers, list(questions[0].ids),
                   [(m, 1) for m in methods] + [(m, opts.batch) for m in batched],
                   {("width", w): job for w, job in wjobs.items()},
                   0 if opts.mesh else workers)
    _log(f"{name}: compiling {len(futs)} programs in {workers} threads")
    for f in futs.values():  # timings start once nothing compiles beside them
        _wait(f, budget)
    out["compile_wall_s"] = time.perf_counter() - t  # this shape's programs, at once
    _log(f"{name}: compiled in {out['compile_wall_s']:.1f} s; width curve")
    if opts.mesh:
        out["width_curve"] = {"not_run": "a single-device measurement: not on a mesh"}
    else:
        width_curve(lm, {w: futs[("width", w)] for w in wjobs}, cache, opts.capacity,
                    opts.repeats, budget, out.setdefault("width_curve", {}), save)
    out["kernels_forward"] = out["width_curve"].get("kernels_forward")
    ms = out.setdefault("methods", {})
    ref = {"kernels_forward": (out["kernels_forward"] or {}).get("kernels")}
    ready = _ready(futs, [(m, 1) for m in methods], budget, ms)
    _log(f"{name}: methods {ready}")
    defer: list = []  # greedy divergences, classified after every timing
    run_methods(lm, questions, settings, layers, ready[:1], budget, ms, ref, save, defer)
    if "tokens_per_s" in ref:
        out["ar_vs_bound"] = bench.bandwidth_bound(lm.params, ref["tokens_per_s"], probe)
        _log(f"  ar: {ms['ar']['tokens_per_s']:.1f} tok/s = "
             f"{100 * out['ar_vs_bound']['ar_fraction_of_bound']:.0f}% of the bound "
             f"{out['ar_vs_bound']['bound_tokens_per_s']:.1f} tok/s")
        save()
    _hf_phase(lm, shape, opts, questions, budget, out, save)
    run_methods(lm, questions, settings, layers, ready[1:], budget, ms, ref, save, defer)
    if batched:
        bq = bench.random_questions(opts.batch, opts.prompt_len, cfg.vocab_size, seed=1)
        run_batched(lm, bq, settings, _ready(futs, [(m, opts.batch) for m in batched], budget,
                                         out.setdefault("batched", {})),
                    opts.batch, budget, out["batched"], save, defer)
    classify_deferred(defer, budget, save)
    for f in futs.values():  # what the budget left uncompiled does not start now
        f.cancel()
    _PREPARED.clear()
    del lm
    _compile.clear_all()
    gc.collect()


def _listed(shape: dict, key: str = "methods") -> list[str]:
    """The methods a shape lists under ``key`` (``methods`` or ``batched``; ``all``: every
    method drafting for its family, ``_all_methods``)."""
    spec = shape.get(key) or ""
    return list(_all_methods(_family(shape))) if spec == "all" else \
        _split(spec) if spec else []


def _methods_of(shape: dict, opts, key: str) -> list[str]:
    """A shape's methods (``ar`` first: the reference), narrowed by ``--methods``."""
    methods = _listed(shape, key)
    if opts.methods:
        methods = [m for m in methods if m in _split(opts.methods)]
    return (["ar"] if methods else []) + [m for m in methods if m != "ar"]


def not_listed(shape: dict, opts) -> list[str]:
    """The methods ``--methods`` names that ``shape`` does not list: recorded as skipped
    for it (the run is then not complete)."""
    listed = _listed(shape)
    return [m for m in _split(opts.methods or "") if m not in listed]


def _ready(futs: dict, jobs: list, budget: Budget, out: dict) -> list[str]:
    """The methods of ``jobs`` whose programs compiled within the budget; the others go to
    ``out["skipped"]`` (a method whose compile failed still runs, to record its error)."""
    ready = []
    for job in jobs:
        if _wait(futs[job], budget) is None:
            out.setdefault("skipped", []).append(job[0])
        else:
            ready.append(job[0])
    return ready


def _hf_phase(lm, shape: dict, opts, questions, budget: Budget, out: dict, save) -> None:
    """transformers on the same device, or why not."""
    ms = out.get("methods", {})
    if not shape["hf"] or opts.no_hf or opts.mesh:
        return
    if _hf_on_another_device():
        out["hf"] = {"not_applicable": "torch sees no device of JAX's kind here: "
                                       "transformers would run on the host CPU"}
        return
    if budget.left() <= 0:
        out["hf"] = {"skipped": "out of time"}
        return
    try:
        run_hf(lm, shape, questions, opts.max_new_tokens, out.setdefault("hf", {}), save)
        if "tokens_per_s" in ms.get("ar", {}):
            out["hf"]["ar_vs_hf"] = ms["ar"]["tokens_per_s"] / out["hf"]["tokens_per_s"]
    except Exception as e:  # noqa: BLE001
        out["hf"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        traceback.print_exc()
    save()


def run_batched(lm, questions, settings: MethodSettings, methods, batch: int, budget: Budget,
                out: dict, save, defer: list) -> None:
    """Each method over the ``batch`` prompts at once (compiled ahead by ``prepare``):
    tokens/s over the batch, time per round against ``ar``'s step at the same batch, and
    every row's greedy tokens against ``ar``'s (rows that differ are classified later,
    through ``defer``, as ``run_methods`` does)."""
    import jax

    from specjax import bench

    ids, ref = [list(q.ids) for q in questions], {}
    for m in methods:
        prep = _PREPARED.get((id(lm), m, batch))
        if budget.left() <= 0:
            out.setdefault("skipped", []).append(m)
            continue
        if prep is None or prep.error:
            out[m] = {"error": prep.error if prep else "not compiled"}
            continue
        kw = dict(max_new_tokens=settings.max_new_tokens, eos_ids=lm.eos_ids,
                  **bench._sampling_kw(None))
        jax.block_until_ready(prep.built(ids, **kw).tokens)  # compiled: a warm run
        t = time.perf_counter()
        o = prep.built(ids, **kw)
        jax.block_until_ready(o.tokens)
        secs = time.perf_counter() - t
        toks, rounds = o.to_lists(), int(np.max(np.asarray(o.target_forwards)))
        n = sum(len(r) for r in toks)
        rec = {"spec": prep.built.name, "batch": batch, "new_tokens": n,
               "tokens_per_s": n / secs, "ms_per_round": 1e3 * secs / rounds,
               "tau": n / float(np.sum(np.asarray(o.target_forwards))),
               "compile_s": prep.compile_s}
        if m == "ar":
            ref.update(tokens=toks, ms=rec["ms_per_round"])
        if ref:
            rec["rows_equal_to_ar"] = sum(a == b for a, b in zip(toks, ref["tokens"]))
            rec["round_vs_ar_step"] = rec["ms_per_round"] / ref["ms"]
            if rec["rows_equal_to_ar"] < batch:
                defer.append((m, functools.partial(
                    _classify, lm, questions, toks, ref["tokens"], prep.built.decoder,
                    settings.max_new_tokens, rec), out))
        out[m] = rec
        _log(f"  batch {batch} {m:<14} {rec['tokens_per_s']:8.1f} tok/s  "
             f"{rec['ms_per_round']:.2f} ms/round ({rec.get('round_vs_ar_step', 1):.2f}x ar "
             f"step)  rows equal to ar {rec.get('rows_equal_to_ar')}/{batch}")
        save()


def _split(spec: str) -> list[str]:
    from specjax import methods

    return methods.split(spec)


def _method_problems(where: str, r: dict, batch: int) -> tuple[list[str], list[str]]:
    """``(skipped, failed)`` of one method's record: an error fails; greedy output that left
    ``ar``'s fails on a real mismatch, and is unfinished while not classified."""
    if "error" in r:
        return [], [f"{where}: {r['error'][:200]}"]
    div = r.get("divergence") or {}
    diverged = r.get("equal_to_ar") is False or r.get("rows_equal_to_ar", batch) < batch
    what = f"{where}: greedy divergence from ar not classified"
    if "error" in div:
        return [], [f"{what}: {div['error'][:200]}"]
    if "skipped" in div or (diverged and not div):
        return [f"{what} ({div.get('skipped', 'out of time')})"], []
    if r.get("real_mismatches"):
        return [], [f"{where}: greedy output left ar's on {r['real_mismatches']} prompts, "
                    "not on a near tie"]
    return [], []


def incomplete(res: dict, batch: int) -> tuple[list[str], list[str]]:
    """``(skipped, failed)``: each thing listed but not measured, and why; each thing
    measured wrong (an error, a failed law check, a real greedy mismatch). The run is
    complete only when both are empty."""
    skipped, failed = [], []
    for ph in res["phases"]:
        if ph["status"] != "done":
            (failed if ph["status"].startswith("error") else skipped).append(
                f"phase {ph['name']}: {ph['status']}")
    if res.get("law") and not res["law"]["passed"]:
        failed.append(f"sampled verification law check: p = {res['law']['p_value']:.3g}, "
                      f"negative control p = {res['law']['control_p_value']:.3g}")
    for name, s in res["shapes"].items():
        skipped += [f"{name}: width {w} (not compiled within the budget)"
                    for w in s.get("width_curve", {}).get("skipped", [])]
        skipped += [f"{name}: {m} (named by --methods, not listed for this shape)"
                    for m in s.get("not_listed", [])]
        for group, tag in (("methods", ""), ("batched", f" at batch {batch}")):
            for m, r in (s.get(group) or {}).items():
                if m == "skipped":
                    skipped += [f"{name}: {x}{tag} (out of time)" for x in r]
                    continue
                sk, fa = _method_problems(f"{name}: {m}{tag}", r, batch)
                skipped, failed = skipped + sk, failed + fa
        hf = s.get("hf") or {}
        if "skipped" in hf:
            skipped.append(f"{name}: transformers ({hf['skipped']})")
        elif "error" in hf:
            failed.append(f"{name}: transformers: {hf['error'][:200]}")
    return skipped, failed


def summary(res: dict) -> str:
    """A few lines per shape: what a reader of the log needs first."""
    lines = [f"device: {res['device']['device_kind']} ({res['device']['platform']} "
             f"x{res['device']['count']}); bandwidth "
             f"{(res.get('bandwidth') or {}).get('GBps', float('nan')):.0f} GB/s; "
             f"{res.get('elapsed_s', 0):.0f} s; complete: {res['complete']}"]
    for name, s in res["shapes"].items():
        rel = s.get("width_curve", {}).get("relative_to_1") or {}
        b, hf, ms = s.get("ar_vs_bound") or {}, s.get("hf") or {}, s.get("methods") or {}
        lines.append(f"{name} ({s.get('dtype')}/{s.get('compute_dtype')}): width "
                     + " ".join(f"{w}:{r:.2f}x" for w, r in rel.items()))
        if b:
            lines.append(f"  ar {b['ar_tokens_per_s']:.1f} tok/s = "
                         f"{100 * b['ar_fraction_of_bound']:.0f}% of the bound "
                         f"({b['bound_ms_per_token']:.2f} ms/token)"
                         + (f"; transformers {hf['tokens_per_s']:.1f} tok/s (ar "
                            f"{hf['ar_vs_hf']:.2f}x)" if "ar_vs_hf" in hf else ""))
        for m, r in ms.items():
            if m == "skipped":
                continue  # listed below, with the reason
            elif "error" in r:
                lines.append(f"  {m}: {r['error'][:120]}")
            else:
                lines.append(f"  {m:<14} round {r['ms_per_round']:.2f} ms "
                             f"({r.get('round_vs_ar_step', 1):.2f}x ar step), compile "
                             f"{r['compile_s']:.1f} s, equal to ar {r.get('equal_to_ar')}, "
                             f"kernels/round {r.get('kernels_per_round')} "
                             f"(forward {(s.get('kernels_forward') or {}).get('kernels')}), "
                             f"host transfers in loop {r.get('host_transfers_in_loop')}")
        for m, r in (s.get("batched") or {}).items():
            if m != "skipped" and "tokens_per_s" in r:
                lines.append(f"  batch {r['batch']} {m:<14} {r['tokens_per_s']:.1f} tok/s, "
                             f"round {r['ms_per_round']:.2f} ms "
                             f"({r.get('round_vs_ar_step', 1):.2f}x ar step), rows equal to "
                             f"ar {r.get('rows_equal_to_ar')}")
    law = res.get("law")
    if law:
        lines.append(f"sampled verification (T=1, {law['platform']}): p = "
                     f"{law['p_value']:.3g}, negative control p = "
                     f"{law['control_p_value']:.3g}: {'passed' if law['passed'] else 'FAILED'}")
    lines += [f"SKIPPED {x}" for x in res.get("skipped", [])]
    lines += [f"FAILED {x}" for x in res.get("failed", [])]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    """Width curves, and each method's round against an ``ar`` step, per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = {k: v for k, v in res["shapes"].items() if isinstance(v, dict)}
    fig, (a, b, k) = plt.subplots(1, 3, figsize=(17, 4.8))
    for name, s in shapes.items():
        rel = s.get("width_curve", {}).get("relative_to_1") or {}
        ws = sorted(int(w) for w in rel)
        if ws:
            a.plot(ws, [rel[w] if w in rel else rel[str(w)] for w in ws], marker="o", ms=3,
                   label=name)
    a.set_xlabel("new tokens in the forward (width)")
    a.set_ylabel("cost / 1-token forward")
    a.set_title(f"width curve, {res['device']['device_kind']}")
    if a.get_legend_handles_labels()[0]:
        a.legend(fontsize=8)
    names = sorted({m for s in shapes.values() for m, r in s.get("methods", {}).items()
                    if "round_vs_ar_step" in r and m != "ar"},
                   key=lambda m: (METHOD_ORDER.index(m) if m in METHOD_ORDER
                                  else len(METHOD_ORDER), m))
    width = 0.8 / max(len(shapes), 1)
    for ax, key, label, title in (
            (b, "round_vs_ar_step", "time per round / ar step",
             "a speculative round against an ar step (random weights)"),
            (k, "kernels_round_vs_forward", "kernels per round / kernels of a forward",
             "kernel launches per round (compiled HLO)")):
        for i, (name, s) in enumerate(shapes.items()):
            v = [s.get("methods", {}).get(m, {}).get(key) or 0.0 for m in ["ar"] + names]
            ax.bar(np.arange(len(names) + 1) + i * width, v, width, label=name)
        ax.axhline(1.0, color="gray", ls="--", lw=1)
        ax.set_xticks(np.arange(len(names) + 1) + width * (len(shapes) - 1) / 2)
        ax.set_xticklabels(["ar"] + names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


@dataclasses.dataclass(frozen=True)
class Settings:
    """One run's settings, those of a full run by default (``settings`` gives a ``small``
    run's): the command line's options, plus the width curve's cache (``capacity`` slots,
    ``filled`` tokens cached). ``shapes`` and ``methods``: comma-separated subsets (None:
    all); ``out``: the directory of the JSON and plot."""

    small: bool = False
    out: str | None = None  # None: a new temporary directory (never the committed results)
    budget: float = 520.0
    shapes: str | None = None
    methods: str | None = None
    widths: str = "1,8,16,32,64"
    batch: int = 8
    workers: int = dataclasses.field(
        default_factory=lambda: min(12, max(2, os.cpu_count() or 1)))
    law_rows: int = 200_000
    prompts: int = 2
    prompt_len: int = 128
    max_new_tokens: int = 128
    repeats: int = 20
    precision: str = "highest"
    no_hf: bool = False
    verify_widths: str = "auto"
    scan_layers: bool = False
    capacity: int = 1024
    filled: int = 800
    mesh: str | None = None  # decode on this mesh (the width curve, transformers, batch off)
    coordinator: str | None = None  # a multi-process run (specjax.distributed.Settings)
    num_processes: int | None = None
    process_id: int | None = None
    distributed_timeout: int = 300


#: each shape's part of the budget, from what a whole phase took on one H200 (2026-11-28,
#: commit d01e7da; docs/device_check_h200.md): SmolLM2 about 200 s and the 8B shape about
#: 200 s (13 programs compiled in 70-112 s, then the methods and the greedy divergences'
#: probes), Gemma about 90 s. With 0.35 / 0.35 / 0.3 of a 430 s budget, the 8B phase ran out
#: after `ar`. The Gemma 4 shares are guesses (not measured yet): 8 programs each, E4B's
#: 42 and 31B's 60 unrolled layers, the 31B's 61 GB of weights drawn first. The five shapes
#: do not fit one default budget: run the Gemma 4 ones apart (--shapes
#: gemma4-e4b,gemma4-31b), or give a longer --budget.
PHASE_SHARE = {"smollm2-135m": 0.4, "llama3.1-8b": 0.4, "gemma3-270m": 0.2,
               "gemma4-e4b": 0.4, "gemma4-31b": 0.5}


def phase_seconds(name: str, rest: Sequence[str], remaining: float) -> float:
    """Seconds for shape ``name``'s phase: its share of ``remaining`` among the shapes
    ``rest`` still to run (``name`` first; a shape not in ``PHASE_SHARE`` weighs 1), so time a
    phase leaves unused goes to the next."""
    w = {n: PHASE_SHARE.get(n, 1.0) for n in rest}
    return max(remaining, 0.0) * w[name] / sum(w.values())


#: what ``--small`` changes: tiny shapes, few tokens, a CPU's minutes
_SMALL = dict(budget=300.0, prompt_len=24, max_new_tokens=16, repeats=3, law_rows=50_000,
              widths="1,4,16", capacity=128, filled=64)


def settings(small: bool = False, **given) -> Settings:
    """A run's ``Settings``: each of ``given`` that is not None, else the default of a full
    run or, with ``small``, of the tiny shapes' run on a CPU."""
    return Settings(**{**(_SMALL if small else {}), "small": small,
                       **{k: v for k, v in given.items() if v is not None}})


def _chosen_shapes(opts: Settings) -> dict[str, dict]:
    """The shapes ``opts.shapes`` names (all when None); ValueError on a name not there."""
    shapes = _shapes(opts.small)
    if not opts.shapes:
        return shapes
    unknown = set(opts.shapes.split(",")) - set(shapes)
    if unknown:
        raise ValueError(f"unknown shapes {sorted(unknown)}; available: {sorted(shapes)}")
    return {k: v for k, v in shapes.items() if k in opts.shapes.split(",")}


#: the smallest value of each numeric option (``check_settings``)
_AT_LEAST = {"batch": 1, "workers": 1, "law_rows": 0, "prompts": 1, "prompt_len": 1,
             "max_new_tokens": 1, "repeats": 1, "capacity": 2, "filled": 1}


def check_settings(opts: Settings) -> dict[str, dict]:
    """The shapes ``opts`` runs, after every check that needs no weights: the numbers'
    ranges, ``--widths``, ``--out`` (a directory that can be written), and ``--methods``
    (each a method spec that a chosen shape lists). ``ValueError`` (one line) on the first
    problem."""
    from specjax import _atomic, methods

    if not opts.budget > 0:
        raise ValueError(f"--budget must be a positive number of seconds, got {opts.budget}")
    for name, low in _AT_LEAST.items():
        v = getattr(opts, name)
        if v < low:
            hint = " (1 skips the batched phase)" if name == "batch" else ""
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}{hint}, got {v}")
    try:
        widths = [int(w) for w in opts.widths.split(",")]
    except ValueError:
        widths = []
    if not widths or min(widths) < 1:
        raise ValueError(f"--widths must be comma-separated positive ints, got {opts.widths!r}")
    if opts.out is not None:
        try:
            _atomic.check_writable(opts.out, f"--out {opts.out}")
        except _atomic.OutputError as e:
            raise ValueError(str(e)) from None
    shapes = _chosen_shapes(opts)
    if opts.methods is not None:
        names = _split(opts.methods)
        if not names:
            raise ValueError("--methods names no method")
        for m in names:
            try:
                methods.parse(m)
            except ValueError as e:  # SpecError: a malformed spec
                raise ValueError(f"--methods {m}: {e}") from None
        listed = {m for s in shapes.values() for m in _listed(s)}
        missing = [m for m in names if m not in listed]
        if missing:
            raise ValueError(f"--methods names {', '.join(missing)}, which no shape run here "
                             f"({', '.join(shapes)}) lists; they run "
                             f"{', '.join(sorted(listed, key=_order(shapes)))}")
    return shapes


def _order(shapes: dict):
    """Sort key of method names: the order the shapes list them in."""
    seen = list(dict.fromkeys(m for s in shapes.values() for m in _listed(s)))
    return seen.index


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/device_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true",
                   help="tiny shapes and few tokens: the same code path on a CPU in a minute")
    p.add_argument("--out", help="directory of the JSON and plot (default: a new temporary "
                   "directory, printed; docs/results only when named)")
    p.add_argument("--budget", type=float, help="seconds for all phases, first compiles "
                                                "included (default 520; --small 300); a run "
                                                "cut short by SIGINT keeps its JSON")
    p.add_argument("--shapes", help="comma-separated subset of the shapes")
    p.add_argument("--methods", help="subset of the methods (default: all)")
    p.add_argument("--widths", help="width curve (default 1,8,16,32,64)")
    p.add_argument("--batch", type=int, help="batch of the batched phase (default 8; 1 skips "
                                             "it): the shapes' `batched` methods")
    p.add_argument("--workers", type=int, help="threads compiling a shape's programs at once "
                                               "(default: the host's cores, at most 12)")
    p.add_argument("--law-rows", type=int, help="rounds of the sampled-verification law "
                                                "check (default 200000, --small 50000; 0 "
                                                "skips it)")
    p.add_argument("--prompts", type=int, help="random prompts per method (default 2)")
    p.add_argument("--prompt-len", type=int, help="tokens per random prompt (default 128)")
    p.add_argument("--max-new-tokens", type=int, help="default 128 (--small: 16)")
    p.add_argument("--repeats", type=int, help="timed forwards per width (default 20)")
    p.add_argument("--precision", default="highest", choices=["highest", "default"],
                   help="JAX matmul precision of float32 products (highest: they stay "
                        "float32 on GPU/TPU, the lossless setting; default: TF32 or bfloat16 "
                        "passes); bfloat16 products always run at the default")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    p.add_argument("--verify-widths", default="auto",
                   help="verification widths of speculative methods, as `specjax bench "
                        "--verify-widths` (default auto: one padded width off CPU)")
    p.add_argument("--scan-layers", action="store_true",
                   help="Llama shapes run their layers under one lax.scan (one layer "
                        "compiles; Gemma and Gemma 4 stay unrolled), as `specjax bench "
                        "--scan-layers`")
    p.add_argument("--mesh", help="decode every method on this mesh of all processes' "
                   "devices, e.g. model=8 (the width curve, transformers and the batched "
                   "phase are skipped there)")
    p.add_argument("--coordinator", help="HOST:PORT of process 0 of a multi-process run, "
                   "with --num-processes and --process-id (as every specjax command)")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    p.add_argument("--distributed-timeout", type=int, help="seconds (default 300)")
    return p


def main(argv=None) -> int:
    """The command line: ``run_check`` with its options' ``settings``; exit status as its,
    2 on a usage error."""
    p = _parser()
    opts = settings(**vars(p.parse_args(argv)))
    try:
        check_settings(opts)
        _join(opts)
    except ValueError as e:
        p.error(str(e))
    return run_check(opts)


def _join(opts: Settings) -> None:
    """Joins the multi-process run the options name (or, with ``--mesh``, the cluster JAX
    detects), before any other JAX call; checks the mesh against the run's devices."""
    from specjax import distributed, sharding

    run = distributed.Settings(opts.coordinator, opts.num_processes, opts.process_id,
                               opts.distributed_timeout)
    distributed.initialize(run, detect=bool(opts.mesh))
    if opts.mesh:
        sizes = sharding.parse_mesh(opts.mesh)
        distributed.check_devices(sizes["data"] * sizes["model"])


def run_check(opts: Settings) -> int:
    """The whole check with ``opts``: writes ``device_check_<device>.json`` (after every
    measurement) and its plot to ``opts.out``, prints a summary; 1 when something was
    measured wrong (``incomplete``'s failures), else 0, complete or not."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the device
    # JAX's allocator grows up to this part of the device's memory (default 75%): the
    # Gemma-4-31B shape's 57.2 GiB of weights need more on an 80 GB card (where JAX's
    # backend starts in this process; scripts/device_check.sh exports it too). The pool
    # grows only as JAX allocates: torch's peers still find the rest
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

    from specjax import bench

    shapes = check_settings(opts)
    if opts.out is None:
        import tempfile

        opts = dataclasses.replace(opts, out=tempfile.mkdtemp(prefix="specjax-device-check-"))
    budget = Budget(opts.budget)
    info = bench.device_info()
    tag = bench.device_tag(info)
    import jax

    out_dir, key = Path(opts.out).absolute(), f"device_check_{tag}"
    final = out_dir / f"{key}.json"
    if jax.process_index() == 0:  # what a killed run left beside the results goes first
        _atomic.recover_files(out_dir, key)
    # the run writes into a staging directory; the JSON and plot replace the previous
    # run's together at the end (publish), so a killed run leaves the previous ones whole
    staging = _atomic.temp_path(out_dir / key)
    path = staging / final.name

    data = {"device": info, "machine": bench.machine_info(), "small": opts.small,
            "mesh": opts.mesh, "processes": jax.process_count(),
            "settings": {k: getattr(opts, k) for k in ("budget", "prompts", "prompt_len",
                                                       "max_new_tokens", "repeats", "widths",
                                                       "capacity", "filled", "precision",
                                                       "verify_widths", "scan_layers",
                                                       "batch", "workers", "law_rows")},
            "weights": "random, real shapes (no trained weights or heads): speed only; tau "
                       "and acceptance are not meaningful",
            "notes": {
                "ms_per_round": "end-to-end seconds / target forwards (the prefill counts as "
                                "one, amortized over the rounds); for ar, one token",
                "round_vs_ar_step": "ms_per_round / ar's ms per token, same prompts",
                "kernels": "from the compiled HLO of the method's decode program: kernels "
                           "= fusions + library calls + unfused ops of one iteration of the "
                           "decoding loop (inner loops at known trip counts, the largest "
                           "branch of a conditional); kernels_forward: a 1-token forward. "
                           "host_transfers (infeed/outfeed/send/recv, host callbacks) must be "
                           "0 in the loop; under XLA:GPU each loop iteration and each "
                           "conditional (whiles, conditionals) also reads its predicate on "
                           "the host, a sync per round that the CPU does not show",
                "hf": "transformers greedy generate on the same device: a random model of "
                      "the same shape and dtype built from its config (not our weights)",
                "width_curve": "one forward over W new tokens with `filled` cached, median "
                               "ms, relative to W = 1"},
            "shapes": {}, "phases": [], "complete": False}
    rep = Report(path, data)
    _log(f"device {info['device_kind']} ({info['platform']} x{info['count']}) -> {final} "
         f"(written to {staging.name} until the run ends)")

    def phase(name: str, seconds: float, fn) -> None:
        budget.phase(seconds)
        t = time.perf_counter()
        status = "done"
        if budget.left() <= 0:
            status = "skipped: out of time"
        else:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 -- record it, go on with the next phase
                status = f"error: {type(e).__name__}: {str(e)[:400]}"
                traceback.print_exc()
        data["phases"].append({"name": name, "seconds": time.perf_counter() - t,
                               "status": status})
        data["elapsed_s"] = budget.elapsed()
        rep.save()
        _log(f"phase {name}: {status} ({time.perf_counter() - t:.1f} s)")

    def probe():
        data["bandwidth"] = bench.bandwidth_probe(nbytes=(16 << 20) if opts.small else None)
        _log(f"bandwidth {data['bandwidth']['GBps']:.1f} GB/s ({data['bandwidth']['method']})")

    def law():
        from specjax.core import lawcheck

        r = lawcheck.law_check(rows=opts.law_rows)
        data["law"] = {**dataclasses.asdict(r), "passed": r.passed,
                       "test": "T=1 rejection sampling on a toy chain: chi-square against the "
                               "exact target law (p > 1e-4), Typical acceptance as the "
                               "negative control (p < 1e-6)"}
        _log(f"sampled verification: p = {r.p_value:.3g}, negative control p = "
             f"{r.control_p_value:.3g} ({r.rows} rounds, {r.seconds:.1f} s): "
             f"{'passed' if r.passed else 'FAILED'}")

    try:
        phase("bandwidth", 30, probe)
        if opts.law_rows:
            phase("law", 60, law)
        for i, (name, shape) in enumerate(shapes.items()):
            phase(name, phase_seconds(name, list(shapes)[i:], budget.remaining()),
                  lambda name=name, shape=shape: check_shape(
                      name, shape, opts, budget,
                      data.get("bandwidth") or bench.bandwidth_probe(),
                      data["shapes"].setdefault(name, {}), rep.save))
    except KeyboardInterrupt:  # the hard time limit (SIGINT): keep what was measured
        data["phases"].append({"name": "interrupted", "seconds": 0.0,
                               "status": "interrupted at the hard time limit"})
        _log("interrupted: writing what was measured")
    data["skipped"], data["failed"] = incomplete(data, opts.batch)
    data["complete"] = not data["skipped"] and not data["failed"]
    data["elapsed_s"] = budget.elapsed()
    rep.save()
    print(summary(data), flush=True)
    if jax.process_index() != 0:  # process 0 writes the results (bench.write_json too)
        return 1 if data["failed"] else 0
    try:
        plot(data, path.with_suffix(".png"))
        note = ""
    except Exception as e:  # noqa: BLE001 -- the JSON is the result; the plot is a view
        note = f"; no plot ({type(e).__name__}: {e})"
    publish(staging, out_dir, key)
    _log(f"wrote {final}" + (note or f" and {final.with_suffix('.png')}"))
    return 1 if data["failed"] else 0


def publish(staging: Path, out_dir: Path, key: str) -> None:
    """Moves the run's ``KEY.json`` and ``KEY.png`` from ``staging`` into ``out_dir``,
    replacing the previous run's pair as one (``specjax._atomic.replace_files``: a run
    without a plot leaves none beside its JSON), then removes ``staging``."""
    import shutil

    _atomic.replace_files(staging, out_dir, [f"{key}.json", f"{key}.png"], key)
    shutil.rmtree(staging, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
