"""Benchmark harness: our decoding methods against HF transformers, side by side in one run.

Every method decodes the same prompts with the same model and thread count. Methods are
interleaved per prompt so that machine noise hits all of them alike. Compile time is
excluded from tokens/s and reported separately.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import threading
import time
from collections import defaultdict
from importlib import resources
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
            "humanities"}
CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclasses.dataclass(frozen=True)
class Question:
    qid: int
    category: str
    text: str
    ids: tuple[int, ...] | None = None  # given token ids (a model without a tokenizer)


def random_questions(n: int, length: int, vocab_size: int, seed: int = 0) -> list[Question]:
    """``n`` prompts of ``length`` seeded random token ids in ``[2, vocab_size)``: the input
    of a random-weight model with no tokenizer, where only speed is meaningful."""
    rng = np.random.default_rng(seed)
    return [Question(i, "random", "", tuple(int(t) for t in rng.integers(2, vocab_size, length)))
            for i in range(n)]


def load_questions(path: str | Path | None = None, categories: Sequence[str] | None = None,
                   limit: int | None = None) -> list[Question]:
    """Questions in Spec-Bench's ``question.jsonl`` format (first turn only).

    MT-bench's eight categories are grouped as ``mt_bench``, as Spec-Bench reports them.
    ``limit`` keeps that many questions in total, taken round-robin over the categories so
    that they are spread evenly. Without ``path``, the project's own small prompt set is used.
    A missing ``path`` or a directory raises ``FileNotFoundError`` / ``IsADirectoryError``,
    a malformed or empty file ``ValueError`` naming ``file:line``, all before any model.
    """
    if path is None:
        name = "specjax/data/prompts.jsonl"
        text = resources.files("specjax").joinpath("data/prompts.jsonl").read_text()
    else:
        name = str(path)
        if Path(path).is_dir():
            raise IsADirectoryError(f"questions file {name} is a directory; give a "
                                    "question.jsonl file")
        if not Path(path).is_file():
            raise FileNotFoundError(f"questions file {name} does not exist")
        text = Path(path).read_text()
    by_cat: dict[str, list[Question]] = defaultdict(list)
    for num, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        q = _parse_question(line, f"{name}:{num}")
        cat = "mt_bench" if q.category in MT_BENCH else q.category
        if categories and cat not in categories:
            continue
        by_cat[cat].append(dataclasses.replace(q, category=cat))
    if not by_cat and not categories:
        raise ValueError(f"{name} holds no questions")
    if categories:
        unknown = set(categories) - set(by_cat)
        if unknown:
            raise ValueError(f"no questions in categories {sorted(unknown)}; "
                             f"available: {sorted(by_cat)}")
    picked, i = [], 0
    total = sum(len(v) for v in by_cat.values())
    limit = total if limit is None else min(limit, total)
    while len(picked) < limit:
        for cat in by_cat:
            if i < len(by_cat[cat]) and len(picked) < limit:
                picked.append(by_cat[cat][i])
        i += 1
    return picked


def _parse_question(line: str, where: str) -> Question:
    """One ``question.jsonl`` record; ``ValueError`` naming ``file:line`` if malformed."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in ("question_id", "category", "turns") if k not in row]
    if missing:
        raise ValueError(f"{where}: record lacks {', '.join(map(repr, missing))} (Spec-Bench "
                         f"format: question_id, category, turns)")
    turns = row["turns"]
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) \
            or not turns[0].strip():
        raise ValueError(f"{where}: 'turns' must be a list whose first entry is a non-empty "
                         f"string")
    try:
        qid = int(row["question_id"])
    except (TypeError, ValueError):
        raise ValueError(f"{where}: question_id {row['question_id']!r} is not an integer") \
            from None
    return Question(qid, str(row["category"]), turns[0])


@dataclasses.dataclass
class Run:
    """One method on one prompt."""

    tokens: list[int]
    seconds: float
    target_forwards: int
    compile_s: float = 0.0
    accepted_at: list[int] | None = None  # rounds whose accepted path reached position i
    levels: dict | None = None  # HSD: forwards, drafted and accepted per level
    verified_tokens: int | None = None  # summed width of the verification forwards


Method = Callable[[list[int], int], Run]


def _timed(call):
    """``(output, seconds, compile_s)``; a call that compiled is repeated, so the time is
    always that of an already-compiled executable."""
    t = time.perf_counter()
    out = call()
    out.tokens.block_until_ready()
    dt, compile_s = time.perf_counter() - t, out.compile_s
    if compile_s > 0:
        t = time.perf_counter()
        out = call()
        out.tokens.block_until_ready()
        dt = time.perf_counter() - t
    return out, dt, compile_s


def _sampling_kw(sampler, seed: int = 0) -> dict:
    import jax

    from specjax.core import sampling

    sampler = sampling.Greedy() if sampler is None else sampler
    return {"sampler": sampler, "key": jax.random.key(seed)}


def decoder_method(lm, built, sampler=None) -> Method:
    """specjax decoding with a built method (``specjax.methods.build``: any decoder and its
    parameters); greedy by default. The returned function's ``built`` attribute is
    ``built`` (what ``classify_greedy`` reads the verification width from)."""

    def run(ids: list[int], n: int) -> Run:
        kw = dict(max_new_tokens=n, eos_ids=lm.eos_ids, **_sampling_kw(sampler))
        out, dt, compile_s = _timed(lambda: built([ids], **kw))
        kind = built.spec.kind
        levels = None if kind != "hsd" else {
            "forwards": np.asarray(out.forwards).tolist(),
            "drafted": np.asarray(out.drafted).tolist(),
            "accepted": np.asarray(out.accepted).tolist()}
        spec = kind not in ("ar", "hsd")
        return Run(out.to_lists()[0], dt, int(out.target_forwards[0]), compile_s,
                   np.asarray(out.accepted_at[0]).tolist() if spec else None, levels,
                   int(out.verified_tokens[0]) if spec else None)

    run.built = built
    return run


def ar_method(lm, sampler=None) -> Method:
    """specjax autoregressive decoding (one jitted while_loop); greedy by default."""
    from specjax import methods

    return decoder_method(lm, methods.build(methods.AR(), lm), sampler)



def peer_method(spec, lm, threads: int, hf, temperature: float = 0.0,
                assistant: str | None = None) -> Method:
    """The bench method of a transformers peer (``methods.Peer``, ``decodes`` False):
    ``hf`` is ``hf_method``, ``hf-pld`` is ``hf_pld_method``, ``hf-mtp`` is
    ``hf_mtp_method`` with the Gemma 4 assistant directory ``assistant``, on
    transformers' ``hf``."""
    if spec.name == "hf":
        return hf_method(lm, threads, hf, temperature)
    if spec.name == "hf-mtp":
        return hf_mtp_method(lm, threads, assistant, spec.depth, hf)
    return hf_pld_method(lm, threads, hf)


def load_hf(lm):
    """transformers' model of the same weights: the GGUF file, or the HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    if lm.source.is_dir():
        cls = AutoModelForSeq2SeqLM if lm.is_encoder_decoder else AutoModelForCausalLM
        return cls.from_pretrained(str(lm.source), dtype=torch.float32).eval().to(_torch_device())
    return AutoModelForCausalLM.from_pretrained(
        str(lm.source.parent), gguf_file=lm.source.name,
        dtype=torch.float32).eval().to(_torch_device())


def _torch_device() -> str:
    """Where transformers runs: the GPU when PyTorch sees one (as JAX then does), else CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _hf_generate(hf, ids: list[int], **kw):
    """``(output ids on the host, seconds)`` of one ``generate`` call, synchronized."""
    import torch

    x = torch.tensor([ids], device=_torch_device())
    with torch.inference_mode():
        t = time.perf_counter()
        y = hf.generate(x, attention_mask=torch.ones_like(x), **kw)
        if x.is_cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
    return y.cpu(), dt


def _hf_new_tokens(lm, ids: list[int], y) -> list[int]:
    """The generated ids of ``generate``'s output: after the prompt for a decoder-only
    model, after the decoder start token for an encoder-decoder one."""
    return y[0, 1 if lm.is_encoder_decoder else len(ids):].tolist()


def _hf_stops(hf, lm) -> dict:
    """``generate``'s stop settings for ``lm``: its EOS ids; or, for a model without any (an
    HF directory without tokenizer files, random weights), none at all, so that
    ``generate`` emits exactly ``max_new_tokens`` as specjax does. transformers fills an
    unset ``eos_token_id`` from the model's own ``generation_config`` (e.g. a config's
    default ``eos_token_id=2``), so that is cleared on ``hf`` too."""
    eos = list(lm.eos_ids)
    if eos:
        return {"eos_token_id": eos, "pad_token_id": eos[0]}
    gc = hf.generation_config
    pad = gc.pad_token_id if isinstance(gc.pad_token_id, int) else 0
    gc.eos_token_id = None
    if getattr(gc, "forced_eos_token_id", None) is not None:
        gc.forced_eos_token_id = None
    return {"eos_token_id": None, "pad_token_id": pad}


def _warm_up_ids(lm) -> list[int]:
    return lm.encode("warm up") if lm.tokenizer is not None else [5, 6, 7]


def hf_pld_method(lm, threads: int, hf=None, num_tokens: int = 10) -> Method:
    """HF transformers' prompt-lookup assisted generation (greedy), the peer of the n-gram
    drafter; target forwards are counted with a forward hook."""
    import torch

    torch.set_num_threads(threads)
    hf = load_hf(lm) if hf is None else hf
    return _counted_greedy(lm, hf, prompt_lookup_num_tokens=num_tokens)


def _counted_greedy(lm, hf, **kw) -> Method:
    """transformers' greedy ``generate`` with ``kw`` (an assisted generation's), target
    forwards counted with a forward hook; warmed up once."""
    stops = _hf_stops(hf, lm)
    calls = [0]
    hf.model.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))

    def run(ids: list[int], n: int) -> Run:
        calls[0] = 0
        y, dt = _hf_generate(hf, ids, max_new_tokens=n, do_sample=False, **kw, **stops)
        return Run(_hf_new_tokens(lm, ids, y), dt, calls[0])

    run(_warm_up_ids(lm), 4)
    return run


def hf_mtp_method(lm, threads: int, assistant: str, depth: int = 4, hf=None) -> Method:
    """HF transformers' assisted generation (greedy) with a Gemma 4 assistant
    (``Gemma4AssistantForCausalLM`` from the directory ``assistant``, float32), drafting
    ``depth`` tokens a round (its ``generation_config.num_assistant_tokens``, which
    transformers reads): the peer of ``mtp:depth``. Target forwards are counted with a
    forward hook."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    hf = load_hf(lm) if hf is None else hf
    ast = AutoModelForCausalLM.from_pretrained(str(assistant), dtype=torch.float32)
    ast = ast.eval().to(_torch_device())
    ast.generation_config.num_assistant_tokens = depth
    return _counted_greedy(lm, hf, assistant_model=ast)


def hf_method(lm, threads: int, hf=None, temperature: float = 0.0) -> Method:
    """HF transformers' ``generate`` on the same GGUF weights, in float32 (greedy, or
    sampling at ``temperature``)."""
    import torch

    torch.set_num_threads(threads)
    hf = load_hf(lm) if hf is None else hf
    stops = _hf_stops(hf, lm)

    def run(ids: list[int], n: int) -> Run:
        samp = dict(do_sample=True, temperature=temperature, top_k=0) if temperature > 0 \
            else dict(do_sample=False)
        y, dt = _hf_generate(hf, ids, max_new_tokens=n, **stops, **samp)
        toks = _hf_new_tokens(lm, ids, y)
        if stops["eos_token_id"] is None and len(toks) != n:
            raise RuntimeError(f"transformers stopped after {len(toks)} of {n} tokens on a "
                               f"model without EOS ids (its generation config stops it)")
        return Run(toks, dt, len(toks))

    run(_warm_up_ids(lm), 4)
    return run


def copy_bandwidth(nbytes: int = 256 << 20, threads: int | None = None, repeats: int = 5) -> float:
    """Best-of-``repeats`` memory copy bandwidth in bytes/s, counting bytes read + written.

    ``threads`` threads (default: all cores) each copy their own slice of a ``nbytes``
    buffer with NumPy (which releases the GIL), so every core streams memory at once.
    """
    threads = threads or os.cpu_count() or 1
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    parts = np.array_split(np.arange(src.size), threads)
    bounds = [(p[0], p[-1] + 1) for p in parts]

    def copy(lo, hi):
        np.copyto(dst[lo:hi], src[lo:hi])

    best = float("inf")
    for _ in range(repeats):
        ts = [threading.Thread(target=copy, args=b) for b in bounds]
        t = time.perf_counter()
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best


def device_copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5, steps: int = 8,
                          device=None) -> float:
    """Best-of-``repeats`` memory bandwidth of ``device`` (default: JAX's first device) in
    bytes/s, counting bytes read + written, measured on the device itself.

    One jitted call adds 1 to a float32 array of ``nbytes`` ``steps`` times in a
    ``fori_loop`` (a loop, so XLA cannot fuse the passes into one): each pass streams the
    whole array in and out of device memory. Timed with ``block_until_ready`` after a
    compiling, warming call. On the CPU this measures host memory through XLA:CPU."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    device = device or jax.devices()[0]
    x = jax.device_put(jnp.zeros((max(nbytes // 4, 1),), jnp.float32), device)
    passes = jax.jit(lambda x: lax.fori_loop(0, steps, lambda i, y: y + 1.0, x))
    jax.block_until_ready(passes(x))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(passes(x))
        best = min(best, time.perf_counter() - t)
    return 2 * steps * x.nbytes / best


def device_info() -> dict:
    """The JAX device that decodes: platform, kind (e.g. ``NVIDIA H100 80GB HBM3``), count."""
    import jax

    d = jax.devices()[0]
    return {"platform": d.platform, "device_kind": d.device_kind, "count": jax.device_count(),
            "backend": jax.default_backend()}


def device_tag(info: dict | None = None) -> str:
    """A short file-name tag for the device: ``h100``, ``h200``, ``a100``, ``v5e``...;
    ``cpu`` on the host."""
    import re

    info = info or device_info()
    if info["platform"] == "cpu":
        return "cpu"
    kind = info["device_kind"].lower()
    m = re.search(r"\b([a-z]{1,2}\d{1,4}[a-z]?)\b", kind.replace("nvidia", ""))
    if info["platform"] == "tpu":
        m = re.search(r"v\d+[a-z]*( ?lite| ?[ep])?", kind) or m
    tag = m.group(0) if m else kind
    return re.sub(r"[^a-z0-9]+", "_", tag).strip("_") or info["platform"]


def bandwidth_probe(nbytes: int | None = None, repeats: int = 5) -> dict:
    """The memory bandwidth that bounds decoding on the device JAX decodes on.

    On a GPU or TPU: ``device_copy_bandwidth`` on the device (1 GiB by default), the bound
    of a bandwidth-bound forward there. On the CPU: ``copy_bandwidth``, threaded NumPy
    copies of host memory (256 MiB by default). Returns ``{"GBps", "method", "device"}``."""
    info = device_info()
    if info["platform"] == "cpu":
        nbytes = nbytes or 256 << 20
        bw = copy_bandwidth(nbytes, repeats=repeats)
        method = (f"host: best of {repeats} multi-threaded numpy copies of {nbytes >> 20} MiB, "
                  f"read + written bytes")
    else:
        nbytes = nbytes or 1 << 30
        bw = device_copy_bandwidth(nbytes, repeats=repeats)
        method = (f"device: best of {repeats} jitted calls of 8 passes of x + 1 over "
                  f"{nbytes >> 20} MiB of float32 in device memory, read + written bytes")
    return {"GBps": bw / 1e9, "method": method, "device": info}


def bandwidth_bound(params, ar_tokens_per_s: float, probe: dict | None = None) -> dict:
    """``ar`` against the bandwidth bound of the device it ran on: every weight read once
    per token at the ``bandwidth_probe`` rate (KV cache reads not counted)."""
    import jax

    probe = probe or bandwidth_probe()
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    bound = probe["GBps"] * 1e9 / weight_bytes
    return {"copy_GBps": probe["GBps"], "weight_bytes": int(weight_bytes),
            "bound_tokens_per_s": bound, "bound_ms_per_token": 1e3 / bound,
            "ar_tokens_per_s": ar_tokens_per_s, "ar_fraction_of_bound": ar_tokens_per_s / bound,
            "method": probe["method"], "device": probe["device"]}


def _summary(runs: list[tuple[Question, Run]]) -> dict:
    toks = sum(len(r.tokens) for _, r in runs)
    secs = sum(r.seconds for _, r in runs)
    fwd = sum(r.target_forwards for _, r in runs)
    out = {"tokens_per_s": toks / secs if secs else 0.0, "new_tokens": toks, "seconds": secs,
           "tau": toks / fwd if fwd else 0.0, "n": len(runs), "target_forwards": fwd,
           "compile_s": sum(r.compile_s for _, r in runs), "acceptance_by_position": None}
    acc = [r.accepted_at for _, r in runs]
    if all(a is not None for a in acc) and acc:
        rounds = sum(r.target_forwards - 1 for _, r in runs)  # the prefill is not a round
        out["acceptance_by_position"] = (np.sum(acc, axis=0) / max(rounds, 1)).tolist()
        ver = [r.verified_tokens for _, r in runs]
        if all(v is not None for v in ver):  # tokens in a verification forward, per round
            out["tokens_per_forward"] = sum(ver) / max(rounds, 1)
    lv = [r.levels for _, r in runs]
    if lv and all(x is not None for x in lv):  # HSD: per-level counts and acceptance rates
        out["levels"] = {k: np.sum([x[k] for x in lv], axis=0).tolist() for k in lv[0]}
        d, a = (np.asarray(out["levels"][k], float) for k in ("drafted", "accepted"))
        out["levels"]["acceptance"] = (a[1:] / np.maximum(d[1:], 1)).tolist()
        out["ms_per_token"] = 1e3 * secs / max(toks, 1)
    return out


def summarize(results: dict[str, list[tuple[Question, Run]]]) -> dict:
    """Per-method and per-category tokens/s, speedup vs ``ar`` and tau."""
    out = {}
    for name, runs in results.items():
        s = _summary(runs)
        cats = defaultdict(list)
        for q, r in runs:
            cats[q.category].append((q, r))
        s["per_category"] = {c: _summary(v) for c, v in cats.items()}
        out[name] = s
    if "ar" in out:
        ar = out["ar"]
        for s in out.values():
            s["speedup_vs_ar"] = s["tokens_per_s"] / ar["tokens_per_s"]
            for c, cs in s["per_category"].items():
                cs["speedup_vs_ar"] = cs["tokens_per_s"] / ar["per_category"][c]["tokens_per_s"]
    return out


def classify_greedy(lm, results: dict[str, list[tuple[Question, Run]]], runners: dict,
                    prompt_ids: Callable[[Question], list[int]]) -> dict[str, dict]:
    """Every specjax method's greedy output against ``ar``'s, question by question: per
    method with a verification width (its runner's ``built`` decoder; ``ar`` and the
    transformers peers have none), ``specjax.divergence.report`` over (question id,
    classification). Only questions whose tokens differ are classified (one prefill and
    ``W + 1`` forwards each); ``prompt_ids`` gives a question's prompt then."""
    from specjax import divergence

    ref = {q.qid: r.tokens for q, r in results["ar"]}
    out = {}
    for name, runs in results.items():
        built = getattr(runners.get(name), "built", None)
        width = None if built is None else divergence.verification_width(built.decoder)
        if name == "ar" or width is None:
            continue
        chunk = getattr(built.decoder, "chunk", 64)
        out[name] = divergence.report([
            (q.qid, None if r.tokens == ref[q.qid] else divergence.classify(
                lm, prompt_ids(q), ref[q.qid], r.tokens, width, chunk=chunk))
            for q, r in runs])
    return out


def first_mismatch(classified: dict[str, dict]) -> tuple[str, dict] | None:
    """``(method, record)`` of the first real mismatch in ``classify_greedy``'s result."""
    for name, rep in classified.items():
        for rec in rep["records"]:
            if rec["kind"] == "mismatch":
                return name, rec
    return None


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def format_table(summary: dict) -> str:
    cats = sorted({c for s in summary.values() for c in s["per_category"]})
    head = (f"{'method':<10}{'tok/s':>8}{'vs ar':>7}{'tau':>6}{'tok/fwd':>8}  "
            + "".join(f"{c[:12]:>13}" for c in cats))
    lines = [head, "-" * len(head)]
    for name, s in summary.items():
        per = "".join(f"{s['per_category'][c]['tokens_per_s']:>8.1f}"
                      f"{'(' + format(s['per_category'][c].get('speedup_vs_ar', 0), '.2f') + ')':>5}"
                      if c in s["per_category"] else f"{'-':>13}" for c in cats)
        lines.append(f"{name:<10}{s['tokens_per_s']:>8.1f}{s.get('speedup_vs_ar', 0):>7.2f}"
                     f"{s['tau']:>6.2f}{_fmt(s.get('tokens_per_forward')):>8}  {per}")
    lines.append("per category: tok/s (speedup vs ar); tok/fwd: tokens per verification forward")
    eq = {n: s["greedy_vs_ar"] for n, s in summary.items() if "greedy_vs_ar" in s}
    if eq:
        lines.append("greedy vs ar (prompts): " + "; ".join(
            f"{n} {c['equal']} equal, {c['near_tie']} near tie, {c['mismatch']} mismatch"
            for n, c in eq.items()))
    return "\n".join(lines)


def machine_info() -> dict:
    import jax

    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "jax": jax.__version__,
            "jax_devices": [str(d) for d in jax.devices()], "backend": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind, "device": device_info()}


def run_records(results: dict[str, list[tuple[Question, Run]]]) -> dict[str, list[dict]]:
    """Every method's runs as JSON, one record per question: what a resumed bench restores."""
    return {m: [{"question": q.qid, "category": q.category, **dataclasses.asdict(r)}
                for q, r in runs] for m, runs in results.items()}


def restore_runs(path: str | Path | None, settings: dict) -> dict[str, dict[int, Run]]:
    """Per method, the runs (by question id) of an earlier bench written to ``path`` with
    the same ``settings``; empty when ``path`` does not exist yet.

    Raises ``ValueError`` when ``path`` holds another kind of file or a bench with other
    settings, so a resume never mixes runs that do not belong together.
    """
    if path is None or not Path(path).exists():
        return {}
    try:
        old = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} exists but is not a bench report ({e.msg}); choose another "
                         f"--out or remove it") from None
    if not isinstance(old, dict) or "settings" not in old or "runs" not in old:
        raise ValueError(f"{path} exists but holds no resumable bench (no settings and runs); "
                         f"choose another --out or remove it")
    if old["settings"] != settings:
        diff = sorted(k for k in {*settings, *old["settings"]}
                      if settings.get(k) != old["settings"].get(k))
        raise ValueError(f"{path} holds a bench with other settings ({', '.join(diff)}); "
                         f"choose another --out to start a new one")
    fields = {f.name for f in dataclasses.fields(Run)}
    return {m: {rec["question"]: Run(**{k: v for k, v in rec.items() if k in fields})
                for rec in recs} for m, recs in old["runs"].items()}


def write_json(path: str | Path, obj: dict) -> None:
    """Writes ``obj`` to ``path`` atomically (a killed write leaves the old file intact);
    in a multi-process run, only process 0 writes."""
    import jax

    if jax.process_index() != 0:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)
