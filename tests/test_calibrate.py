"""HSD self-calibration on a toy model: the agreement matrix equals a direct count, costs are
measured per width, tuning returns the best predicted hierarchy, and specs parse strictly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import toys
import specjax
from specjax.hsd import calibrate, hierarchy
from specjax.hsd.spec import HierarchySpec
from specjax import hsd
from specjax.core import sampling
from specjax.drafters.exit_heads import exit_head, init_heads
from specjax.models import Llama
from specjax.models.llama import init_params

V = toys.V
TOY = toys.LLAMA_DEEP
LAYERS = (1, 2)
NG = specjax.NGramDrafter(depth=4, min_ngram=1)


@pytest.fixture(scope="module")
def toy():
    model = Llama(TOY)
    tp = jax.tree.map(lambda x: x * 3.0, init_params(TOY, jax.random.key(1)))
    heads = init_heads(TOY, LAYERS, jax.random.key(2), rank=4)
    heads = {int(l): jax.tree.map(lambda x: x + 0.3, hp) for l, hp in heads.items()}
    prompts = [[1, 5, 2, 7, 5], [3, 3, 1, 4], [7, 2, 7, 2, 7, 9]]
    out = specjax.generate(model, tp, prompts, max_new_tokens=30).to_lists()
    return model, tp, heads, [p + o for p, o in zip(prompts, out)], [len(p) for p in prompts]


def _argmaxes(model, tp, heads, seq):
    """Each exit's and the target's argmax at every position of ``seq``, teacher-forced."""
    @jax.jit
    def run(tp, heads, t):
        logits, hid, _ = model.forward(tp, t, jnp.arange(t.shape[1])[None],
                                       model.init_cache(1, 64), return_layers=LAYERS)
        rows = [jnp.argmax(exit_head(model, tp, heads[l], hid[l])[0], -1) for l in LAYERS]
        return rows + [jnp.argmax(logits[0], -1)]

    return [np.asarray(r) for r in run(tp, heads, jnp.asarray(seq)[None])]


def test_greedy_agreement_equals_a_direct_count(toy):
    model, tp, heads, seqs, pls = toy
    alpha, n = calibrate.agreement(model, tp, heads, LAYERS, seqs, pls, ngram=NG)
    # the n-gram drafter's first proposal given tokens 0..t-1, one context at a time (jitted:
    # eager, the lookup's many small operations take most of this test's time)
    first = jax.jit(lambda ctx: NG.propose(None, (), ctx, None, sampling.Greedy())[0])
    hits, total = np.zeros((4, 4)), 0
    for seq, pl in zip(seqs, pls):
        am = _argmaxes(model, tp, heads, seq)
        for t in range(pl, len(seq)):  # predicting token t
            ctx = specjax.drafters.Context(tokens=jnp.asarray(seq)[None],
                                           length=jnp.asarray([t]), prompt_len=jnp.asarray([pl]),
                                           cache=None, params=None)
            d = first(ctx)
            guess = [int(d.tokens[0, 0]) if bool(d.valid[0, 0]) else -1]
            guess += [int(a[t - 1]) for a in am]
            for i in range(4):
                for j in range(i + 1, 4):
                    hits[i, j] += guess[i] == guess[j] and guess[i] >= 0
            total += 1
    assert n == total == sum(len(s) - p for s, p in zip(seqs, pls))
    np.testing.assert_allclose(alpha, hits / total, atol=1e-6)
    assert np.all(np.tril(alpha) == 0) and 0 < alpha[2, 3] < 1


def test_sampled_agreement_is_one_minus_total_variation(toy):
    model, tp, heads, seqs, pls = toy
    smp = sampling.Sample(temperature=1.0)
    alpha, _ = calibrate.agreement(model, tp, heads, LAYERS, seqs[:1], pls[:1], smp, ngram=NG)
    t = jnp.asarray(seqs[0])[None]
    logits, hid, _ = model.forward(tp, t, jnp.arange(t.shape[1])[None],
                                   model.init_cache(1, 64), return_layers=LAYERS)
    sl = slice(pls[0] - 1, t.shape[1] - 1)
    p1 = jax.nn.softmax(exit_head(model, tp, heads[1], hid[1])[0, sl], -1)
    p3 = jax.nn.softmax(logits[0, sl], -1)
    want = 1 - 0.5 * np.mean(np.sum(np.abs(np.asarray(p1) - np.asarray(p3)), -1))
    np.testing.assert_allclose(alpha[1, 3], want, rtol=1e-5)


def test_costs_are_measured_for_every_candidate_and_width(toy):
    model, tp, heads, _, _ = toy
    c = calibrate.forward_costs(model, tp, heads, LAYERS, (1, 3), capacity=64, filled=20,
                                repeats=3, ngram=NG)
    assert set(c) == {"ngram", "exit 1", "exit 2", "target"}
    assert all(v > 0 for t in c.values() for v in t.values())
    assert set(c["target"]) == {1, 3} and set(c["ngram"]) == {1}


def test_round_overhead_is_the_step_beyond_its_forward(toy):
    model, tp, _, _, _ = toy
    r = calibrate.round_overhead(model, tp, filled=40, T=3, repeats=3)
    assert r["filled"] == 40 and r["T"] == 3
    assert r["loop_round_ms"] > 0 and r["forward_ms"] > 0 and r["lookup_ms"] > 0
    assert r["round_ms"] == pytest.approx(max(r["loop_round_ms"] - r["forward_ms"]
                                              - r["lookup_ms"], 0.0))
    # the overhead enters every verifying level's cost, not the bottom's
    flat = {k: {"1": v["1"]} for k, v in CALIB["cost_ms"].items()}
    base = calibrate.level_costs(flat, (1, 2, 3), (3, 2), CALIB["layers"])
    more = calibrate.level_costs(flat, (1, 2, 3), (3, 2), CALIB["layers"], round_ms=0.5)
    assert more == pytest.approx([base[0], base[1] + 0.5, base[2] + 0.5])
    assert calibrate.predicted_latency({**CALIB, "round": {"round_ms": 0.5}}, (0, 3), (4,)) > \
        calibrate.predicted_latency(CALIB, (0, 3), (4,))


def test_ngram_hit_rate_counts_positions_with_a_proposal():
    # min_ngram=1: after [1, 2, 1] the suffix 1 recurs (hit); in [5, 6, 7] nothing recurs
    ng = specjax.NGramDrafter(depth=2, min_ngram=1)
    assert calibrate.ngram_hit_rate([[1, 2, 1, 2]], [3], ng) == 1.0
    assert calibrate.ngram_hit_rate([[5, 6, 7, 8]], [3], ng) == 0.0
    assert calibrate.ngram_hit_rate([[5, 6, 7, 8], [1, 2, 1, 2]], [3, 3], ng) == 0.5
    # a miss costs level 1 a width-1 forward only under per-width verification
    cal = {**CALIB, "ngram_hit": 0.25}
    full = calibrate.predicted_latency(cal, (0, 3), (3,))
    assert calibrate.predicted_latency({**cal, "verify_widths": "padded"}, (0, 3), (3,)) == full
    per = calibrate.level_costs(CALIB["cost_ms"], (0, 3), (3,), CALIB["layers"], ngram_hit=0.25)
    assert per[1] == pytest.approx(0.25 * 12.0 + 0.75 * 8.0)
    assert calibrate.predicted_latency({**cal, "verify_widths": "per-width"}, (0, 3), (3,)) < full


def test_decode_position_is_the_mean_cache_length_of_decoded_tokens():
    # positions 3, 4 (prompt 3, 5 tokens) and 1, 2, 3 (prompt 1, 4 tokens)
    assert calibrate.decode_position([[0] * 5, [0] * 4], [3, 1]) == round((3 + 4 + 1 + 2 + 3) / 5)
    assert calibrate.decode_position([[0] * 3], [3]) == 0


CALIB = {"layers": [1, 2],
         "alpha": [[0, 0.3, 0.35, 0.3], [0, 0, 0.8, 0.6], [0, 0, 0, 0.85], [0, 0, 0, 0]],
         "cost_ms": {"ngram": {"1": 0.2}, "exit 1": {"1": 2.0, "4": 3.0, "16": 6.0},
                     "exit 2": {"1": 4.0, "4": 6.0, "16": 12.0},
                     "target": {"1": 8.0, "4": 12.0, "16": 24.0}}}


def test_level_costs_follow_the_widths_hsd_runs():
    c = calibrate.level_costs(CALIB["cost_ms"], (1, 2, 3), (3, 2), CALIB["layers"])
    # bottom: width-1 steps plus a catch-up forward of width 1 + top = 3, over T[0] = 3
    assert c[0] == pytest.approx(2.0 + (2.0 + (3.0 - 2.0) * 2 / 3) / 3)
    # level 1 verifies M[1] = 3 drafts at width 3 + 1 + (2 - 1) = 5; the target M[2] = 5, width 6
    assert c[1] == pytest.approx(6.0 + (12.0 - 6.0) / 12)
    assert c[2] == pytest.approx(12.0 + (24.0 - 12.0) * 2 / 12)
    flat = {k: {"1": v["1"]} for k, v in CALIB["cost_ms"].items()}
    # one n-gram lookup proposes the whole fill of T[0] tokens
    assert calibrate.level_costs(flat, (0, 3), (4,), CALIB["layers"]) == [0.05, 8.0]
    a = np.asarray(CALIB["alpha"])
    assert calibrate.predicted_latency({**CALIB, "cost_ms": flat}, (0, 3), (4,)) == \
        pytest.approx(hierarchy.latency([0.05, 8.0], a[np.ix_((0, 3), (0, 3))], (0, 1), (4,)))


def test_noisy_costs_never_fall_with_width():
    # timing noise measured width 4 faster than width 1: extrapolating that slope would
    # give wide verifications a negative cost
    noisy = {"1": 0.6, "4": 0.3}
    assert calibrate._cost_at(noisy, 4) == pytest.approx(0.6)
    assert calibrate._cost_at(noisy, 17) == pytest.approx(0.6)
    assert calibrate._cost_at({"1": 1.0, "4": 0.5, "8": 2.0}, 12) == pytest.approx(3.0)


def test_tune_returns_the_least_predicted_latency():
    lat, sigma, T, h, table = calibrate.tune(CALIB, t_max=5, max_levels=4)
    assert h == 0 and {r["horizontal"] for r in table} == {0}
    assert lat == pytest.approx(calibrate.predicted_latency(CALIB, sigma, T))
    assert lat == pytest.approx(min(r["latency_ms"] for r in table)) and lat < 8.0
    assert {r["sigma"] for r in table} == {(0, 3), (1, 3), (2, 3), (0, 1, 3), (0, 2, 3),
                                           (1, 2, 3), (0, 1, 2, 3)}
    for r in table:  # each row's T is the best for its sigma
        for other in np.ndindex(*(5,) * len(r["T"])):
            T2 = tuple(int(x) + 1 for x in other)
            assert r["latency_ms"] <= calibrate.predicted_latency(CALIB, r["sigma"], T2) + 1e-9
    with pytest.raises(ValueError, match="t_max"):
        calibrate.tune(CALIB, t_max=0)
    with pytest.raises(ValueError, match="max_levels"):
        calibrate.tune(CALIB, max_levels=1)
    wide = calibrate.level_costs(CALIB["cost_ms"], (2, 3), (30,), CALIB["layers"])
    assert wide[1] == pytest.approx(24.0 + (31 - 16) * 12.0 / 12)  # extended past width 16


def test_tune_weighs_the_horizontal_heuristic():
    """Level 0's extra drafts pay when it agrees with the levels above and costs little,
    and never when it never agrees; costs count the wider buffers and level 0's work."""
    c = calibrate.level_costs(CALIB["cost_ms"], (1, 2, 3), (3, 2), CALIB["layers"], 4)
    # level 1 as before (width 5); the target's buffer M[2] = 2 + 3 + 4 = 9, width 10
    assert c[1] == pytest.approx(6.0 + (12.0 - 6.0) / 12)
    assert c[2] == pytest.approx(12.0 + (24.0 - 12.0) * 6 / 12)
    assert calibrate.horizontal_cost(CALIB["cost_ms"], 1, 2, 4, CALIB["layers"]) == \
        pytest.approx((2.0 + 1.0 * 2 / 3) + 4 * 2.0)
    assert calibrate.horizontal_cost(CALIB["cost_ms"], 0, 2, 4, CALIB["layers"]) == 0.2
    good = {**CALIB, "alpha": [[0, 0.8, 0.8, 0.8], [0, 0, 0.8, 0.6], [0, 0, 0, 0.85],
                               [0, 0, 0, 0]]}
    lat, sigma, T, h, table = calibrate.tune(good, t_max=4, horizontal=(0, 3))
    row = {(r["sigma"], r["horizontal"]): r for r in table}
    assert lat == pytest.approx(min(r["latency_ms"] for r in table))
    assert lat == pytest.approx(calibrate.predicted_latency(good, sigma, T, horizontal=h))
    assert row[(0, 2, 3), 3]["latency_ms"] < row[(0, 2, 3), 0]["latency_ms"]
    assert row[(0, 2, 3), 3]["latency_ms"] == pytest.approx(
        calibrate.predicted_latency(good, (0, 2, 3), row[(0, 2, 3), 3]["T"], horizontal=3))
    assert {k for k in row if len(k[0]) == 2} == {((i, 3), 0) for i in range(3)}  # no h rows
    never = {**good, "alpha": [[0, 0, 0, 0]] + good["alpha"][1:]}
    row = {(r["sigma"], r["horizontal"]): r for r in calibrate.tune(never, 4, horizontal=(0, 3))[4]}
    assert all(r["latency_ms"] > row[k[0], 0]["latency_ms"] for k, r in row.items() if k[1])
    with pytest.raises(ValueError, match="horizontal"):
        calibrate.tune(CALIB, horizontal=(-1,))


def test_cli_tune_ranks_horizontal_specs(tmp_path, capsys):
    import json

    from specjax import cli

    f, out = tmp_path / "calib.json", tmp_path / "tune.json"
    f.write_text(json.dumps({**CALIB, "alpha": [[0, 0.8, 0.8, 0.8]] + CALIB["alpha"][1:]}))
    assert cli.main(["tune", "--calibration", str(f), "--t-max", "3", "--horizontal", "0,3",
                     "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["ranking"]
    specs = {r["spec"] for r in rows}
    assert {"ngram:1,2:1,target+h3", "ngram:3,2:1,target"} <= specs
    assert all(r["spec"].endswith("+h3") == (r["horizontal"] == 3) for r in rows)
    with pytest.raises(SystemExit):
        cli.main(["tune", "--calibration", str(f), "--horizontal", "0,-2"])
    assert "non-negative" in capsys.readouterr().err


def test_hierarchy_specs_parse_strictly_and_run(toy):
    model, tp, heads, seqs, pls = toy
    assert calibrate.parse_hierarchy("ngram:4,2:3,target", LAYERS) == ((0, 2, 3), (4, 3))
    assert calibrate.format_hierarchy((0, 2, 3), (4, 3), LAYERS) == "ngram:4,2:3,target"
    spec = "ngram:4,2@0.5:3,target"  # level 1 drafts at its own temperature
    assert calibrate.parse_hierarchy(spec, LAYERS) == ((0, 2, 3), (4, 3))
    assert HierarchySpec.parse(spec).temperatures == (None, 0.5, None)
    assert HierarchySpec.parse(spec).format() == spec
    assert calibrate.format_hierarchy((0, 2, 3), (4, 3), LAYERS, (None, 0.5)) == spec
    h, _ = calibrate.hierarchy_from((0, 2, 3), (4, 3), LAYERS, heads, (None, 0.5))
    assert h.levels[1].temperature == 0.5 and h.levels[2].temperature is None
    spec = "ngram:4,2@0.5:3,target+h10"  # and the horizontal heuristic
    assert calibrate.parse_hierarchy(spec, LAYERS) == ((0, 2, 3), (4, 3))
    assert HierarchySpec.parse(spec).horizontal == 10
    assert calibrate.format_hierarchy((0, 2, 3), (4, 3), LAYERS, (None, 0.5), 10) == spec
    assert calibrate.hierarchy_from((0, 2, 3), (4, 3), LAYERS, heads, None, 10)[0].horizontal == 10
    for bad in ("ngram@0.5:4,target", "2@x:3,target", "2@-1:3,target", "2:3,target+hx"):
        with pytest.raises(ValueError, match="temperature|level|horizontal"):
            calibrate.parse_hierarchy(bad, LAYERS)
    for bad in ("ngram:4,2:3", "3:2,target", "ngram:0,target", "ngram,target", "target"):
        with pytest.raises(ValueError, match="hierarchy|level"):
            calibrate.parse_hierarchy(bad, LAYERS)
    h, hp = calibrate.hierarchy_from((0, 1, 3), (3, 2), LAYERS, heads)
    assert isinstance(h.levels[0], hsd.NGram) and h.levels[1].layer == 1 and hp[1] is heads[1]
    prompts = [s[:p] for s, p in zip(seqs, pls)]
    out = hsd.hsd_generate(model, tp, h, prompts, max_new_tokens=30, hparams=hp)
    assert out.to_lists() == [s[p:] for s, p in zip(seqs, pls)]


def test_cli_calibrate_tune_and_bench_hsd_auto(monkeypatch, tmp_path, capsys):
    """calibrate, tune and bench with the tuned hierarchy, through the CLI, on a 4-layer toy
    saved as an HF directory (plain exits at layers 1 and 3)."""
    import json

    import toys
    from specjax import cli

    toy = toys.loaded_llama(tmp_path / "toy")
    monkeypatch.setattr("specjax.models.load", lambda *a, **k: toy)
    calib = tmp_path / "calib.json"
    assert cli.main(["calibrate", "--model", "toy", "--layers", "1,3", "--limit", "2",
                     "--max-new-tokens", "12", "--widths", "1,4", "--out", str(calib)]) == 0
    c = json.loads(calib.read_text())
    assert c["candidates"] == ["ngram", "exit 1", "exit 3", "target"] and c["positions"] > 0
    a = np.asarray(c["alpha"])
    assert np.all((0 <= a) & (a <= 1)) and a[2, 3] > a[1, 3]  # the deeper exit agrees more
    assert set(c["cost_ms"]["target"]) == {"1", "4"} and c["cost_ms"]["exit 1"]["1"] > 0
    assert cli.main(["tune", "--calibration", str(calib), "--t-max", "4"]) == 0
    assert "best:" in capsys.readouterr().out
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--model", "toy", "--methods", "ar,hsd:auto",
                     "--calibration", str(calib),
                     "--t-max", "4", "--limit", "2", "--max-new-tokens", "12",
                     "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["greedy_mismatch_vs_ar"] == []
    lv = rep["methods"]["hsd:auto"]["levels"]
    assert lv["forwards"][-1] == rep["methods"]["hsd:auto"]["target_forwards"]
    spec = rep["hsd"]["hierarchies"]["hsd:auto"]  # the tuned hierarchy, recorded as a spec
    sigma, T = calibrate.parse_hierarchy(spec, c["layers"])
    assert sigma[-1] == 3 and len(T) == len(sigma) - 1
