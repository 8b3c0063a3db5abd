"""Bad input: one-line CLI errors before any model loads, sampler values checked, and an
interrupted bench that resumes to the same report."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import bench, cli
from specjax.core import sampling


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if a command gets as far as loading weights."""
    def load(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")
    monkeypatch.setattr("specjax.models.load", load)


def _bad_files(tmp_path):
    good = '{"question_id": 1, "category": "qa", "turns": ["hi"]}'
    files = {"malformed.jsonl": f"{good}\n{{bad\n", "noturns.jsonl": '{"question_id": 1, '
             '"category": "qa"}\n', "empty.jsonl": "", "list.jsonl": "[1, 2]\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


PROBES = [  # argv, exit code, a piece of the message
    (["generate", "--prompt", "hi", "--temperature", "-1"], 2, "--temperature must be >= 0"),
    (["generate", "--prompt", "hi", "--temperature", "0.8", "--top-p", "0"], 2, "--top-p"),
    (["generate", "--prompt", "hi", "--top-p", "1.5"], 2, "--top-p must be in (0, 1]"),
    (["generate", "--prompt", "hi", "--top-k", "-1"], 2, "--top-k must be >= 0"),
    (["generate", "--prompt", "  "], 2, "--prompt is empty"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], 2, "--max-new-tokens must be"),
    (["generate"], 2, "--prompt"),
    (["bench", "--methods", "foo"], 2, "unknown methods ['foo']"),
    (["bench", "--methods", "ar,hf-pld", "--temperature", "1"], 2, "hf-pld is greedy only"),
    (["bench", "--questions", "{d}/malformed.jsonl"], 1, "malformed.jsonl:2: not valid JSON"),
    (["bench", "--questions", "{d}/noturns.jsonl"], 1, "noturns.jsonl:1: record lacks 'turns'"),
    (["bench", "--questions", "{d}/empty.jsonl"], 1, "empty.jsonl holds no questions"),
    (["bench", "--questions", "{d}/list.jsonl"], 1, "list.jsonl:1: expected a JSON object"),
    (["bench", "--questions", "{d}/missing.jsonl"], 1, "missing.jsonl does not exist"),
    (["train", "eagle", "--data", "x"], 2, "--run"),
    # non-finite sampling values, unwritable outputs and corrupt inputs: named at once
    (["generate", "--prompt", "hi", "--temperature", "inf"], 2, "--temperature must be a finite"),
    (["generate", "--prompt", "hi", "--temperature", "nan"], 2, "--temperature must be a finite"),
    (["generate", "--prompt", "hi", "--method", "foo"], 2, "unknown method 'foo'"),
    (["generate", "--prompt", "hi", "--method", "eagle2:3,4"], 2, "want depth,topk,total"),
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
