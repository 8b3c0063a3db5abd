"""Greedy equality with a stated tolerance (``specjax.divergence``): where a method's greedy
output leaves ``ar``'s, the first divergence is a near tie (``ar``'s margin there within
the measured width gap) or a real mismatch, and ``specjax bench`` and the device check
report it; a real mismatch fails them. One tiny float32 random Llama (the device check's
small shape) serves every test, so the compiled programs are shared."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import toys

from specjax import bench, divergence, methods

NEW, PROMPT_LEN, N_PROMPTS = 16, 12, 2


@pytest.fixture(scope="module")
def tiny():
    """The device check's tiny Llama (float32 weights and products), sharpened as there."""
    dc = toys.device_check()
    return dc.random_model("tiny-llama", dc._shapes(small=True)["tiny-llama"], scale=3.0)


@pytest.fixture(scope="module")
def questions(tiny):
    """What ``specjax bench --random-prompts 2 --prompt-len 12`` decodes."""
    return bench.random_questions(N_PROMPTS, PROMPT_LEN, tiny.model.config.vocab_size)


@pytest.fixture(scope="module")
def ar_out(tiny, questions):
    run = methods.build("ar", tiny)
    return [run([list(q.ids)], max_new_tokens=NEW).to_lists()[0] for q in questions]


def _corrupt(monkeypatch, name: str, ids: list[int], at: int, vocab: int) -> None:
    """Every bench runner of method ``name`` returns, for prompt ``ids``, its output with
    token ``at`` replaced by another id (a method wrong on purpose)."""
    real = bench.decoder_method

    def decoder_method(lm, built, sampler=None):
        run = real(lm, built, sampler)
        if built.name != name:
            return run

        def wrong(prompt, n):
            r = run(prompt, n)
            if list(prompt) == ids:
                r.tokens[at] = (r.tokens[at] + vocab // 2) % vocab
            return r

        wrong.built = built
        return wrong

    monkeypatch.setattr(bench, "decoder_method", decoder_method)


def test_judge_and_tally_on_constructed_logits():
    """The classifier unit: a flip to ar's runner-up within the gap is a near tie; the same
    top-2 margin with a flip to a far token is a mismatch; a replay whose argmax is not
    ar's token has a negative margin."""
    logits = np.array([5.0, 4.999, 1.0, -2.0])
    margin, tm, kind = divergence.judge(logits, 0, 1, gap=0.01)
    assert kind == "near_tie" and margin == pytest.approx(0.001) and tm == pytest.approx(0.001)
    margin, tm, kind = divergence.judge(logits, 0, 2, gap=0.01)
    assert kind == "mismatch" and margin == pytest.approx(0.001) and tm == pytest.approx(4.0)
    assert divergence.judge(logits, 0, 1, gap=0.0001)[2] == "mismatch"
    # each of the two logits can move by the gap: their difference by twice it
    assert divergence.judge(logits, 0, 1, gap=0.0006)[2] == "near_tie"
    assert divergence.judge(logits, 0, 1, gap=0.00049)[2] == "mismatch"
    margin, tm, kind = divergence.judge(logits, 1, 0, gap=0.0)
    assert margin < 0 and tm < 0 and kind == "near_tie"
    assert divergence.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert divergence.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert divergence.first_difference([1, 2], [1, 2, 3]) == 2
    d = divergence.Divergence(4, 7, 9, 0.1, 0.2, 0.5, 0.4, 9, 8, 8, "near_tie")
    assert divergence.tally([None, d, None]) == {"equal": 2, "near_tie": 1, "mismatch": 0}
    assert divergence.Divergence.from_dict({"prompt": 3, **d.as_dict()}) == d
    assert divergence.report([(0, None), (3, d)])["records"] == [{"prompt": 3, **d.as_dict()}]


def test_float32_width_gap_is_tiny_and_every_method_equals_ar(tiny, questions, ar_out):
    """With float32 products a width-8 forward's logits are one-token decoding's to float32
    rounding (< 1e-4 of the largest logit), and speculative methods equal ar exactly, so
    nothing is classified."""
    for name in ("sd-ngram:7", "sd-early-exit:2"):
        built = methods.build(name, tiny)
        assert divergence.verification_width(built.decoder) == built.decoder.widths[-1] > 1
        for q, a in zip(questions, ar_out):
            out = built([list(q.ids)], max_new_tokens=NEW).to_lists()[0]
            assert out == a, name
            assert divergence.classify(tiny, list(q.ids), a, out, 8) is None
    prefix = list(questions[0].ids) + ar_out[0][:6]
    gaps, wide, ref = divergence.width_gap(tiny.model, tiny.params, prefix, 8)
    assert len(gaps) == 8 and 0 <= gaps.max() < 1e-4 * np.abs(ref).max()
    # the chain is the prefix's last 8 tokens: positions 1..7 predict ar's tokens 0..6
    assert [int(t) for t in wide[1:]] == ar_out[0][:7] and int(np.argmax(ref)) == ar_out[0][6]


def test_a_token_flipped_where_ar_is_sure_is_a_real_mismatch(tiny, questions, ar_out):
    """ar's output with its token at k (the surest of three positions) replaced by ar's
    least likely token there, and ar's output cut short at k: both real mismatches at k."""
    ids, a = list(questions[0].ids), ar_out[0]
    refs = {k: divergence.width_gap(tiny.model, tiny.params, ids + a[:k], 8)[2]
            for k in (2, 5, 9)}
    k = max(refs, key=lambda k: np.sort(refs[k])[-1] - np.sort(refs[k])[-2])
    wrong = list(a)
    wrong[k] = int(np.argmin(refs[k]))  # ar's least likely token there
    d = divergence.classify(tiny, ids, a, wrong, 8)
    assert (d.position, d.ar_token, d.method_token, d.width) == (k, a[k], wrong[k], 8)
    assert d.kind == "mismatch" and d.token_margin > d.margin > 1.0 > 1e3 * d.gap
    assert d.wide_token == a[k] and d.compared == 8
    shorter = divergence.classify(tiny, ids, a, a[:k], 8)
    assert shorter.kind == "mismatch" and shorter.method_token == -1 and shorter.gap is None


def test_a_constructed_near_tie_is_a_near_tie_and_a_wider_split_is_not(tiny, questions,
                                                                       ar_out):
    """Token b's embedding (the tied LM head) is made token a's scaled by 1 + eps, so b's
    logit is a's times 1 + eps everywhere. A method that emits the other one of the pair
    where ar emitted a or b left ar on a near tie when the split is a quarter of the
    measured width gap, and on a real mismatch when eps is 1e-3 (far outside it)."""
    ids, out = list(questions[0].ids), ar_out[0]
    a = out[3]
    k = out.index(a)
    b = next(t for t in range(tiny.model.config.vocab_size) if t not in ids + out)
    gaps, _, ref = divergence.width_gap(tiny.model, tiny.params, ids + out[:k], 8)
    small = float(gaps.max()) / (4 * abs(ref[a]))
    got = {}
    for eps in (small, 1e-3):
        embed = np.asarray(tiny.params["embed"]).copy()
        embed[b] = embed[a] * np.float32(1 + eps)
        lm = dataclasses.replace(tiny, params={**tiny.params, "embed": embed})
        ar = methods.build("ar", lm)([ids], max_new_tokens=NEW).to_lists()[0]
        assert ar[:k] == out[:k] and ar[k] in (a, b)
        flipped = list(ar)
        flipped[k] = b if ar[k] == a else a
        got[eps] = d = divergence.classify(lm, ids, ar, flipped, 8)
        assert d.position == k and d.method_token == flipped[k]
        assert abs(d.token_margin) <= 1.5 * eps * abs(ref[a]) + 1e-6  # the split made
    near, far = got[small], got[1e-3]
    assert near.kind == "near_tie" and near.token_margin <= near.gap
    assert far.kind == "mismatch" and far.token_margin > 2 * far.gap > 0


def test_bench_reports_counts_and_exits_non_zero_on_a_real_mismatch(
        tiny, questions, monkeypatch, tmp_path, capsys):
    """`specjax bench` with sd-ngram made wrong at token 3 of the first prompt: the JSON is
    written (counts equal/near_tie/mismatch and the record), the exit code is 1 and one
    stderr line names the method and the position."""
    from specjax import cli

    monkeypatch.setattr("specjax.models.load", lambda *a, **k: tiny)
    _corrupt(monkeypatch, "sd-ngram:7", list(questions[0].ids), 3, tiny.model.config.vocab_size)
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--methods", "ar,sd-ngram:7", "--random-prompts", str(N_PROMPTS),
                   "--prompt-len", str(PROMPT_LEN), "--max-new-tokens", str(NEW),
                   "--out", str(out)])
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("specjax:")]
    assert rc == 1
    assert len(err) == 1 and "sd-ngram:7" in err[0] and "token 3" in err[0], err
    rep = json.loads(out.read_text())
    assert rep["complete"] and rep["greedy_mismatch_vs_ar"] == [
        {"question": questions[0].qid, "method": "sd-ngram:7"}]
    g = rep["methods"]["sd-ngram:7"]["greedy_vs_ar"]
    assert (g["equal"], g["near_tie"], g["mismatch"]) == (1, 0, 1)
    (r,) = g["records"]
    assert r["prompt"] == questions[0].qid and r["position"] == 3 and r["kind"] == "mismatch"
    assert r["width"] == 8 and r["token_margin"] > r["gap"]
    assert "greedy_vs_ar" not in rep["methods"]["ar"]


def test_device_check_records_real_mismatches(tiny, questions, monkeypatch):
    """`device_check.run_methods`: per method the divergence counts and `real_mismatches`
    (0 for methods equal to ar)."""
    device_check = toys.device_check()
    _corrupt(monkeypatch, "sd-ngram:7", list(questions[1].ids), 5, tiny.model.config.vocab_size)
    settings = device_check.MethodSettings(max_new_tokens=NEW)
    out, ref, defer = {}, {}, []
    device_check.run_methods(tiny, questions, settings, 2,
                             ["ar", "sd-ngram:7", "sd-early-exit:2"],
                             device_check.Budget(600.0), out, ref, lambda: None, defer)
    # the diverging method is classified after every timing, the others at once
    assert [m for m, _, _ in defer] == ["sd-ngram:7"] and "divergence" not in out["sd-ngram:7"]
    assert device_check.incomplete({"phases": [], "shapes": {"s": {"methods": out}}}, 8)[0] \
        == ["s: sd-ngram:7: greedy divergence from ar not classified (out of time)"]
    device_check.classify_deferred(defer, device_check.Budget(600.0), lambda: None)
    assert out["ar"]["real_mismatches"] == 0 and out["sd-early-exit:2"]["real_mismatches"] == 0
    assert out["sd-early-exit:2"]["divergence"]["equal"] == N_PROMPTS
    sd = out["sd-ngram:7"]
    assert sd["equal_to_ar"] is False and sd["real_mismatches"] == 1
    (r,) = sd["divergence"]["records"]
    assert (r["prompt"], r["position"], r["kind"]) == (1, 5, "mismatch")
