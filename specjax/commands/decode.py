"""``specjax generate`` (decode one prompt) and ``specjax demo`` (the main job: a real
prompt with ``ar`` and the fastest lossless method measured on this machine)."""

from __future__ import annotations

import json
import sys
import time

from specjax.commands import common
from specjax.commands.common import UsageError


def run_once(lm, ids: list[int], built, args) -> dict:
    """Decodes ``ids`` with ``built`` twice (the second, timed, is already compiled)."""
    import jax

    kw = dict(max_new_tokens=args.max_new_tokens, sampler=common.sampler(args),
              key=jax.random.key(args.seed), eos_ids=lm.eos_ids)
    out = built([ids], **kw)
    out.tokens.block_until_ready()
    compile_s = out.compile_s
    t = time.perf_counter()
    out = built([ids], **kw)
    out.tokens.block_until_ready()
    dt = time.perf_counter() - t
    toks = out.to_lists()[0]
    res = {"method": built.spec.kind, "spec": built.name, "model": args.model,
           "dtype": args.dtype, "compute_dtype": args.compute_dtype,
           "text": lm.decode(toks), "token_ids": toks,
           "prompt_tokens": len(ids), "new_tokens": len(toks), "seconds": dt,
           "tokens_per_s": len(toks) / dt, "compile_s": compile_s, "tau": out.tau,
           "target_forwards": int(out.target_forwards[0]), "acceptance_by_position": None}
    if built.spec.kind == "hsd":
        res["levels"] = {"forwards": out.forwards.tolist(), "drafted": out.drafted.tolist(),
                         "accepted": out.accepted.tolist()}
    elif built.spec.kind != "ar":
        res["acceptance_by_position"] = out.acceptance_by_position().tolist()
    return res


def fits_context(args, prompt: str, chat: bool | None, slots: int = 0):
    """A ``load(check=...)`` hook: the prompt, its budget and ``slots`` draft slots (the
    method's ``scratch``) fit the model's context. ``chat=None``: the chat template where
    the tokenizer has one."""
    def check(tokenizer, cfg):
        from specjax.models.registry import encode

        if tokenizer is None:
            raise UsageError(f"{args.model} has no tokenizer files: give the prompt as "
                             "--prompt-ids 37,8,15")
        wrap = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
        try:
            n = len(encode(tokenizer, prompt, wrap))
        except ValueError as e:  # --chat on a model without a chat template
            raise UsageError(str(e)) from None
        _fits(args, cfg, n, "a prompt", _encoder_decoder(cfg), slots)
    return check


def fits_ids(args, ids: list[int], slots: int = 0):
    """A ``load(check=...)`` hook: ``--prompt-ids`` lie in the model's vocabulary, and
    they, their budget and ``slots`` draft slots fit its context."""
    def check(tokenizer, cfg):
        if max(ids) >= cfg.vocab_size:
            raise UsageError(f"--prompt-ids has id {max(ids)}, outside the vocabulary of "
                             f"{cfg.vocab_size}")
        _fits(args, cfg, len(ids), "a prompt", _encoder_decoder(cfg), slots)
    return check


def _encoder_decoder(cfg) -> bool:
    return getattr(cfg, "max_source_positions", None) is not None


def _fits(args, cfg, n: int, what: str, encoder_decoder: bool, slots: int = 0) -> None:
    if encoder_decoder:
        if n > cfg.max_source_positions:
            raise UsageError(f"a source of {n} tokens exceeds the encoder's "
                             f"{cfg.max_source_positions} positions")
        need, what = 1 + args.max_new_tokens, "the decoder start token"
    else:
        need, what = n + args.max_new_tokens, f"{what} of {n} tokens"
    need += slots
    if need > cfg.max_position_embeddings:
        draft = f" + {slots} draft slots of --method {args.method}" if slots else ""
        raise UsageError(f"{what} + --max-new-tokens {args.max_new_tokens}{draft} exceeds "
                         f"{args.model}'s context of {cfg.max_position_embeddings} positions")


def prompt_ids(spec: str) -> list[int]:
    try:
        ids = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {spec!r}") from None
    if not ids or min(ids) < 0:
        raise UsageError(f"--prompt-ids needs at least one id, all >= 0; got {spec!r}")
    return ids


def cmd_generate(args) -> int:

    spec = common.parse_method(common.method_text(args))  # checked before the model loads
    common.check_method(spec, args)  # its head directory and calibration too
    m = common.mesh(args)
    slots = common.scratch([spec], args)  # the method's draft slots count in the context
    if args.prompt_ids is not None:
        ids = prompt_ids(args.prompt_ids)
        fits = fits_ids(args, ids, slots)
    else:
        fits = fits_context(args, args.prompt, args.chat, slots)
    # the spec against the model's config, and the prompt, before any weight is read
    lm = common.load(args, m, check=common.config_check(args, [spec], fits))
    if args.prompt_ids is None:
        ids = lm.encode(args.prompt, chat=args.chat)
    built = common.build(spec, lm, args)
    if built.note:
        print(f"note: {built.note}", file=sys.stderr)
    res = run_once(lm, ids, built, args)
    if args.json:
        print(json.dumps(res))
    else:
        print(res["text"] if res["text"] is not None else " ".join(map(str, res["token_ids"])))
        print(f"\n[{res['spec']}] {res['new_tokens']} tokens in {res['seconds']:.2f} s = "
              f"{res['tokens_per_s']:.1f} tok/s (compile {res['compile_s']:.1f} s, excluded)",
              file=sys.stderr)
    return 0


def _demo_run(lm, ids, args, spec, ar: dict | None = None) -> dict:
    """``run_once`` of ``spec``; with ``ar``'s run (greedy), also ``lossless`` and, where
    the tokens differ, ``divergence``: the first one classified (``specjax.divergence``)."""
    from specjax import divergence

    print(f"[{spec.format()}] compiling and decoding {args.max_new_tokens} tokens ...",
          flush=True)
    built = common.build(spec, lm, args)
    r = run_once(lm, ids, built, args)
    if ar is not None:
        r.update(lossless=r["token_ids"] == ar["token_ids"], ar_tokens_per_s=ar["tokens_per_s"])
        width = divergence.verification_width(built.decoder)
        if not r["lossless"] and args.temperature <= 0 and width is not None:
            d = divergence.classify(lm, ids, ar["token_ids"], r["token_ids"], width,
                                    chunk=built.decoder.chunk)
            r["divergence"] = d.as_dict()
    return r


def cmd_demo(args) -> int:
    from specjax import bench, demo, methods
    from specjax.models import load

    explicit = None if args.method == "auto" else common.parse_method(common.method_text(args))
    if explicit is not None:
        common.check_method(explicit, args)  # before the model loads
    print(f"loading {args.model} ...", flush=True)
    prompt = args.prompt or next(q.text for q in bench.load_questions()
                                 if q.category == "summarization")
    slots = 0 if explicit is None else common.scratch([explicit], args)
    fits = fits_context(args, prompt, None, slots)
    lm = load(args.model, **common.dtypes(args),
              check=fits if explicit is None else common.config_check(args, [explicit], fits))
    ids = lm.encode(prompt, chat=lm.has_chat_template)
    print(f"prompt ({len(ids)} tokens): {prompt[:200]}{'...' if len(prompt) > 200 else ''}")
    cands = demo.available(args.model)
    greedy = args.temperature <= 0
    choice = explicit or (None if (args.remeasure or not greedy)
                          else demo.read_choice(args.model, cands))
    if explicit is None and choice is not None:
        print(f"fastest lossless method measured here before: {choice.format()} "
              f"(record: {demo.cache_file(args.model)}; --remeasure to measure again)")
    elif explicit is None and greedy:
        print(f"measuring {len(cands)} lossless configurations on this prompt (once per "
              f"machine; the fastest is recorded)")
    ar = _demo_run(lm, ids, args, methods.AR())
    runs = {}
    for spec in ([choice] if choice is not None else cands if greedy else cands[-1:]):
        runs[spec.format()] = _demo_run(lm, ids, args, spec, ar)
    if choice is None:
        choice = demo.write_choice(args.model, runs, cands) if greedy else cands[-1]
    _report(choice.format(), ar, runs)
    if not greedy:
        return 0
    return _verdict(runs)


def _verdict(runs: dict) -> int:
    """Says whether each greedy run equals ``ar``'s, and how a different one left it:
    1 if any left it with a real mismatch (not a near tie), else 0."""
    from specjax.divergence import Divergence

    bad = [n for n, r in runs.items() if not r["lossless"]]
    print(f"greedy output of {', '.join(runs)} is "
          f"{'identical to' if not bad else 'DIFFERENT FROM'} ar" + (f" ({bad})" if bad else ""))
    real = False
    for n in bad:
        d = runs[n].get("divergence")
        if d is not None:
            print(f"  {n}: {d['kind'].replace('_', ' ')} at {Divergence.from_dict(d).line()}")
        real = real or d is None or d["kind"] == "mismatch"
    return 1 if real else 0


def _report(best: str, ar: dict, runs: dict) -> None:
    print("\n" + runs[best]["text"] + "\n")
    for name, r in [("ar", ar), *runs.items()]:
        mark = "*" if name == best else " "
        print(f"{mark} {name:<16} {r['new_tokens']} tokens in {r['seconds']:.2f} s = "
              f"{r['tokens_per_s']:6.1f} tok/s  {r['tokens_per_s'] / ar['tokens_per_s']:.2f}x ar, "
              f"tau {r['tau']:.2f} tokens/forward (compile {r['compile_s']:.1f} s, excluded)")
    print(f"speedup of {best} over ar: {runs[best]['tokens_per_s'] / ar['tokens_per_s']:.2f}x")


def register(sub) -> list:
    """Adds this module's commands to ``sub``; returns their parsers."""
    g = sub.add_parser("generate", help="decode one prompt")
    common.add_model(g)
    common.add_mesh(g)
    common.add_sampling(g)
    common.add_method(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-ids", help="the prompt as token ids, e.g. 37,8,15 (the encoder "
                     "input of an encoder-decoder model; for models without a tokenizer)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    common.add_check_weights(g)
    g.set_defaults(fn=cmd_generate)

    d = sub.add_parser("demo", help="decode a real prompt and show tokens/s")
    common.add_model(d)
    common.add_sampling(d)
    common.add_method(d)
    d.add_argument("--prompt", help="default: the built-in summarization prompt")
    d.add_argument("--remeasure", action="store_true",
                   help="measure every candidate again instead of using the recorded fastest")
    d.set_defaults(method="auto")  # auto: the fastest lossless configuration measured here
    d.set_defaults(fn=cmd_demo)
    return [g, d]
