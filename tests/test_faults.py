"""Bad input: one-line CLI errors before any model loads, sampler values checked, and an
interrupted bench that resumes to the same report."""

from __future__ import annotations

import json
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import bench, cli, methods
from specjax.core import sampling


def _bad_files(tmp_path):
    good = '{"question_id": 1, "category": "qa", "turns": ["hi"]}'
    files = {"malformed.jsonl": f"{good}\n{{bad\n", "noturns.jsonl": '{"question_id": 1, '
             '"category": "qa"}\n', "empty.jsonl": "", "list.jsonl": "[1, 2]\n",
             # head directories that hold no usable head, and another model's calibration
             "nohead/notes.txt": "x", "cfgonly/config.json": "{}",
             "eagle3head/head.json": '{"kind": "eagle3"}',
             "othercal.json": '{"model": "other", "layers": [1]}'}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "emptydir").mkdir()
    return tmp_path


GEN = ["generate", "--prompt", "hi"]


def _with_head(method: str, path: str) -> list[str]:
    return [*GEN, "--method", method, "--draft-checkpoint", path]


PROBES = [  # argv, exit code, a piece of the message
    ([*GEN, "--temperature", "-1"], 2, "--temperature must be >= 0"),
    ([*GEN, "--temperature", "0.8", "--top-p", "0"], 2, "--top-p"),
    ([*GEN, "--top-p", "1.5"], 2, "--top-p must be in (0, 1]"),
    ([*GEN, "--top-k", "-1"], 2, "--top-k must be >= 0"),
    (["generate", "--prompt", "  "], 2, "--prompt is empty"),
    ([*GEN, "--max-new-tokens", "0"], 2, "--max-new-tokens must be"),
    (["generate"], 2, "--prompt"),
    (["bench", "--methods", "foo"], 2, "unknown methods ['foo']"),
    (["bench", "--methods", "ar,hf-pld", "--temperature", "1"], 2, "hf-pld is greedy only"),
    (["bench", "--questions", "{d}/malformed.jsonl"], 1, "malformed.jsonl:2: not valid JSON"),
    (["bench", "--questions", "{d}/noturns.jsonl"], 1, "noturns.jsonl:1: record lacks 'turns'"),
    (["bench", "--questions", "{d}/empty.jsonl"], 1, "empty.jsonl holds no questions"),
    (["bench", "--questions", "{d}/list.jsonl"], 1, "list.jsonl:1: expected a JSON object"),
    (["bench", "--questions", "{d}/missing.jsonl"], 2, "missing.jsonl does not exist"),
    (["train", "eagle", "--data", "x"], 2, "--run"),
    # non-finite sampling values, unwritable outputs and corrupt inputs: named at once
    ([*GEN, "--temperature", "inf"], 2, "--temperature must be a finite"),
    ([*GEN, "--temperature", "nan"], 2, "--temperature must be a finite"),
    ([*GEN, "--method", "foo"], 2, "unknown method 'foo'"),
    ([*GEN, "--method", "eagle2:3,4"], 2, "want depth,topk,total"),
    (["calibrate", "--out", "{d}/empty.jsonl/x.json"], 2, "empty.jsonl is a file"),
    (["tune", "--calibration", "{d}/malformed.jsonl"], 2,
     "malformed.jsonl is not a calibration JSON file"),
    (["tune", "--calibration", "{d}/missing.json"], 2, "cannot read calibration"),
    (["bench", "--out", "{d}"], 2, "is a directory; give a file path"),
    (["distill", "--prompts", "p", "--out", "{d}/empty.jsonl"], 2, "is a file; give a directory"),
    (["features", "--prompts", "p", "--out", "{d}/list.jsonl/c"], 2, "list.jsonl is a file"),
    (["train", "eagle", "--data", "x", "--run", "{d}/empty.jsonl"], 2, "--run"),
    (["train", "redrafter", "--data", "x", "--run", "r", "--export", "{d}/list.jsonl/h"], 2,
     "--export"),
    # spec rules a builder needs, refused when parsed
    ([*GEN, "--method", "eagle3:7,10,5"], 2,
     "eagle3:7,10,5: total (5) must be >= depth (7)"),
    (["bench", "--methods", "ar,eagle2:2,2,7"], 2, "must be <= the 6 nodes"),
    ([*GEN, "--method", "hsd:8:3,4:3,target"], 2,
     "exit layers must increase"),
    (["bench", "--methods", "hsd:ngram:9,target"], 2, "fewer than T[0]=9"),
    # prompt files: missing, a directory, empty
    (["bench", "--questions", "{d}/emptydir"], 2, "--questions"),
    (["calibrate", "--prompts", "{d}/missing.jsonl", "--out", "{d}/c.json"], 2,
     "--prompts"),
    (["calibrate", "--prompts", "{d}/emptydir", "--out", "{d}/c.json"], 2,
     "emptydir is a directory; give a file"),
    (["calibrate", "--prompts", "{d}/empty.jsonl", "--out", "{d}/c.json"], 1,
     "empty.jsonl holds no questions"),
    # head directories: what is wrong with the path given, before the target loads
    (_with_head("eagle2", "{d}/missing"), 2, "missing does not exist"),
    (_with_head("eagle3", "{d}/emptydir"), 2, "emptydir is empty: want an exported eagle3 head"),
    (_with_head("eagle3", "{d}/empty.jsonl"), 2, "empty.jsonl is a file; give the directory"),
    (_with_head("eagle3", "{d}/nohead"), 2, "nohead has no head.json and no config.json"),
    (_with_head("eagle2", "{d}/cfgonly"), 2, "cfgonly has config.json but no weights"),
    (_with_head("eagle2", "{d}/eagle3head"), 2,
     "holds an exported 'eagle3' head, not 'eagle': use --method eagle3"),
    ([*GEN, "--method", "eagle3"], 2, "pass --draft-checkpoint DIR"),
    (["bench", "--methods", "ar,eagle3", "--draft-checkpoint", "{d}/nohead"], 2,
     "nohead has no head.json"),
    (["demo", "--method", "eagle3", "--draft-checkpoint", "{d}/emptydir"], 2,
     "emptydir is empty"),
    ([*GEN, "--method", "redrafter", "--redrafter-checkpoint", "{d}/emptydir"], 2,
     "--redrafter-checkpoint"),
    (["bench", "--methods", "hsd:ngram:4,target", "--exit-heads", "{d}/missing"], 2,
     "--exit-heads"),
    # hsd's calibration
    ([*GEN, "--method", "hsd"], 2, "needs a calibration"),
    (["bench", "--methods", "ar,hsd"], 2, "needs a calibration: --calibration FILE"),
    (["bench", "--methods", "hsd", "--calibration", "{d}/othercal.json"], 2,
     "othercal.json was measured for 'other'"),
    (["bench", "--methods", "hsd", "--calibration", "{d}/missing.json"], 2,
     "cannot read calibration"),
]


@pytest.mark.parametrize("argv,code,msg", PROBES, ids=[" ".join(p[0][:4]) for p in PROBES])
def test_cli_errors_are_one_line_before_the_model_loads(argv, code, msg, tmp_path, no_model,
                                                        capsys, monkeypatch):
    monkeypatch.delenv("SPECJAX_DEBUG", raising=False)
    d = _bad_files(tmp_path)
    argv = [a.replace("{d}", str(d)) for a in argv]
    try:
        got = cli.main(argv)
    except SystemExit as e:  # argparse's own errors exit from inside parse_args
        got = e.code
    err = capsys.readouterr().err.strip()
    assert got == code, err
    assert len(err.splitlines()) == 1 and err.startswith("specjax: error: "), err
    assert msg in err, err


_LM = types.SimpleNamespace(model=types.SimpleNamespace(config=None), params={})  # no weights

TYPE_ERRORS = [  # a call, then a piece of its TypeError
    (lambda: methods.parse(None),
     "methods.parse: text must be a method's text form (str), got NoneType"),
    (lambda: methods.split(["ar"]), "methods.split: text must be"),
    (lambda: methods.build("ar", "smollm2-135m"),
     "methods.build: lm must be a loaded specjax model (specjax.models.load: Llama, Gemma"),
    (lambda: methods.build("ar", {"model": 1}), "lm must be a loaded specjax model"),
    (lambda: methods.build("ar", None), "got NoneType"),
    (lambda: methods.build({"kind": "ar"}, _LM), "methods.build: spec must be a method spec"),
    (lambda: methods.build("ar", _LM, {"draft_len": 3}), "options must be a methods.Options"),
    (lambda: methods.check(None), "methods.check: spec"),
    (lambda: methods.load_drafter("eagle2", "x"), "methods.load_drafter: lm must be"),
    (lambda: methods.exit_heads(None, methods.Options()), "methods.exit_heads: lm must be"),
    (lambda: methods.speculative("ar", _LM, None, None, None), "options must be"),
    (lambda: methods.read_calibration(None), "path must be a file path"),
]


@pytest.mark.parametrize("call,msg", TYPE_ERRORS, ids=[m[:30] for _, m in TYPE_ERRORS])
def test_python_api_names_the_argument_of_the_wrong_type(call, msg, no_model):
    with pytest.raises(TypeError, match=re.escape(msg)) as e:
        call()
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize("text,msg", [
    ("eagle3:7,10,5", "total (5) must be >= depth (7)"),
    ("eagle2:3,1,2", "total (2) must be >= depth (3)"),
    ("eagle2:1,2,3", "total (3) must be <= the 2 nodes that depth 1 and topk 2 draft"),
    ("eagle3:2,2,7:conf", "total (7) must be <= the 6 nodes"),
    ("eagle2:3,0,3", "each >= 1"),
    ("hsd:4:3,ngram:2,target", "an n-gram level can only be the bottom level"),
    ("hsd:8:3,4:3,target", "exit layers must increase up the hierarchy, got [8, 4]"),
    ("hsd:ngram:8,target", "fewer than T[0]=8"),
    ("hsd:ngram:4,target+h9", "fewer than horizontal=9"),
])
def test_specs_a_builder_cannot_run_are_refused_when_parsed(text, msg):
    with pytest.raises(methods.SpecError, match=re.escape(msg)) as e:
        methods.parse(text)
    assert len(str(e.value).splitlines()) == 1


def test_the_edges_of_the_spec_rules_parse_and_direct_specs_are_checked_too():
    for text in ("eagle2:3,1,3", "eagle2:2,2,6", "eagle3:1,5,5", "hsd:ngram:7,2:3,target"):
        assert methods.parse(text).format() == text
    with pytest.raises(methods.SpecError, match="must be >= depth"):
        methods.Eagle3((7, 10, 5))
    with pytest.raises(methods.SpecError, match="each >= 1"):
        methods.Redrafter((0, 3))
    with pytest.raises(methods.SpecError, match="sd-early-exit:L"):
        methods.SD("early-exit")


def test_a_draft_vocabulary_runs_as_given_or_is_refused(tmp_path):
    """``vocab=N`` keeps exactly N of the head's ranked tokens, so the spec recorded is the
    one that ran; past the target's vocabulary or the head's ranking it is refused."""
    import toys

    from specjax.drafters import eagle
    from specjax.heads import exported

    lm = toys.ToyLM(*toys.llama())
    exported.export_head(eagle.init_head(toys.LLAMA, jax.random.key(2)), tmp_path / "h",
                         {"kind": "eagle", "model": "toy", "draft_vocab": 0,
                          "vocab_ids": list(range(8))}, dtype=np.float32)
    opts = methods.Options(model_name="toy", draft_checkpoint=str(tmp_path / "h"))
    built = methods.build("eagle2:2,2,4:vocab=8", lm, opts)
    assert built.name == "eagle2:2,2,4:vocab=8" and built.params[1]["vocab_ids"].shape == (8,)
    assert "vocab_ids" not in methods.build("eagle2:2,2,4:vocab=12", lm, opts).params[1]
    for n, msg in [(13, "vocab=13 exceeds the target's vocabulary of 12 tokens"),
                   (9, "the head ranks only 8 tokens by frequency")]:
        with pytest.raises(methods.SpecError, match=msg):
            methods.build(f"eagle2:2,2,4:vocab={n}", lm, opts)


def test_debug_shows_the_traceback(tmp_path, no_model):
    d = _bad_files(tmp_path)
    with pytest.raises(ValueError, match="not valid JSON"):
        cli.main(["bench", "--questions", str(d / "malformed.jsonl"), "--debug"])


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(temperature=0), dict(top_k=-1),
                                dict(top_p=0.0), dict(top_p=1.5),
                                dict(temperature=float("inf")), dict(top_p=float("nan"))])
def test_sample_rejects_values_outside_their_range(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        sampling.Sample(**kw)


def test_traced_top_p_of_zero_keeps_the_most_likely_token():
    """Under jit nothing can be raised: a nucleus of mass 0 still keeps the argmax."""
    logits = jnp.asarray([[1.0, 3.0, 2.0], [0.5, -1.0, 0.0]])
    p = jax.jit(lambda tp: sampling.probs(logits, sampling.Sample(1.0, 0, tp)))(jnp.float32(0))
    np.testing.assert_array_equal(np.asarray(p), [[0, 1, 0], [1, 0, 0]])


def test_a_bench_file_of_other_settings_is_not_mixed_in(tmp_path):
    out = tmp_path / "b.json"
    bench.write_json(out, {"settings": {"methods": ["ar"]}, "runs": {"ar": []}})
    assert bench.restore_runs(out, {"methods": ["ar"]}) == {"ar": {}}
    with pytest.raises(ValueError, match="other settings \\(methods\\)"):
        bench.restore_runs(out, {"methods": ["ar", "hf"]})
    out.write_text("{not json")
    with pytest.raises(ValueError, match="not a bench report"):
        bench.restore_runs(out, {})


def test_interrupted_bench_resumes_to_the_same_report(monkeypatch, tmp_path):
    """Killed after 2 of 3 questions, then rerun with the same --out: the report equals an
    uninterrupted run's, speed fields aside, and the finished questions are not decoded again."""
    import toys

    toy = toys.loaded_llama(tmp_path / "toy")  # a 4-layer toy: the resume logic is the point
    monkeypatch.setattr("specjax.models.load", lambda *a, **k: toy)
    calls = []
    real = bench.ar_method

    def counting_ar(lm, sampler=None, stop_at=None):
        run = real(lm, sampler)

        def wrapped(ids, n):
            calls.append(len(ids))
            if stop_at is not None and len(calls) > stop_at:
                raise KeyboardInterrupt
            return run(ids, n)
        return wrapped

    argv = ["bench", "--methods", "ar,sd-ngram", "--limit", "3", "--max-new-tokens", "6"]
    monkeypatch.setattr(bench, "ar_method", counting_ar)
    assert cli.main([*argv, "--out", str(tmp_path / "whole.json")]) == 0
    monkeypatch.setattr(bench, "ar_method", lambda lm, s=None: counting_ar(lm, s, stop_at=5))
    part = tmp_path / "part.json"
    assert cli.main([*argv, "--out", str(part)]) == 130  # interrupted at the third question
    saved = json.loads(part.read_text())
    assert not saved["complete"] and len(saved["runs"]["ar"]) == 2
    monkeypatch.setattr(bench, "ar_method", counting_ar)
    calls.clear()
    assert cli.main([*argv, "--out", str(part)]) == 0
    assert len(calls) == 1  # only the third question was decoded again

    speed = {"seconds", "compile_s", "tokens_per_s", "speedup_vs_ar"}

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in speed | {"bandwidth", "machine"}}
        return [strip(v) for v in x] if isinstance(x, list) else x
    whole, resumed = (json.loads((tmp_path / f).read_text()) for f in ("whole.json", "part.json"))
    assert resumed["complete"] and strip(resumed) == strip(whole)
