"""The prepared accelerator check (``scripts/device_check.sh``, ``scripts/device_check.py``)
runs its whole code path on this CPU in a small setting, and its HLO kernel counts see
loops, branches and host transfers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import toys
from specjax import hlo

ROOT = Path(__file__).resolve().parent.parent


device_check = toys.device_check()


def test_hlo_stats_counts_loops_branches_and_host_transfers():
    def body(i, x):
        x = lax.cond(x.sum() > 0, lambda y: jnp.sin(y) @ y, lambda y: y + 1.0, x)
        return jnp.tanh(x) * 2.0

    def decode(x, n):
        x = lax.fori_loop(0, n, lambda i, y: y * 0.5, x)  # a "prefill" loop first
        return lax.fori_loop(0, 4, body, x)  # the "decoding" loop: the last one

    def with_callback(x):
        def body_cb(i, y):
            jax.debug.callback(lambda v: None, y[0, 0])
            return y + 1.0
        return lax.fori_loop(0, 4, body_cb, x)

    x = jnp.ones((8, 8))
    s = hlo.hlo_stats(jax.jit(decode).lower(x, 3).compile().as_text())
    assert s["host_transfers_in_module"] == 0
    r = s["round"]
    assert r["conditionals"] == 1 and r["host_transfers"] == 0 and r["kernels"] >= 2
    assert s["program"]["whiles"] >= 1 and s["program"]["kernels"] > r["kernels"]
    cb = hlo.hlo_stats(jax.jit(with_callback).lower(x).compile().as_text())
    assert cb["round"]["host_transfers"] >= 1 and cb["host_transfers_in_module"] >= 1
    fwd = hlo.hlo_stats(jax.jit(lambda x: jnp.tanh(x @ x).sum()).lower(x)
                                 .compile().as_text())
    assert fwd["round"] is None and fwd["program"]["kernels"] >= 1


def test_opcode_of_tuple_typed_instructions():
    line = ("  %w = (f32[2]{0}, s32[]) while(%t), condition=%c, body=%b, "
            'backend_config={"known_trip_count":{"n":"7"}}')
    assert hlo._opcode(line) == "while"
    assert hlo._opcode("  ROOT %a.1 = f32[2]{0} add(%x, %y)") == "add"
    comps = {"e": [("while", line)], "b": [("fusion", "  %f = f32[] fusion(%p)")],
             "c": [("fusion", "  %g = pred[] fusion(%p)")]}
    c = hlo.count(comps, "e")
    assert c.whiles == 1 and c.fusions == 7 + 8 and c.kernels == 15  # body 7x, condition 8x


def test_device_check_small_runs_every_method_equal_to_ar(tmp_path):
    """``bash scripts/device_check.sh --small --shapes tiny-llama`` on this CPU, at its
    default budget: the accelerator code path measures every method (and the batched phase),
    each greedy output equal to ar's, the sampled-verification law check passes, and the run
    says it is complete only because nothing was skipped. Then the tiny Gemma 4 shape with
    ar and ``mtp:3`` (the method drafting for Gemma 4 alone, a random assistant), in this
    process: its greedy output equal to ar's, a round's cost in ar steps, transformers'
    Gemma 4 beside. The tiny Gemma shape, which ``--small`` also runs, runs the same code on
    the other family's model (its methods' equality to ar: tests/test_gemma.py); the other
    methods on the Gemma 4 shape run in a whole ``--small`` run: left out here to keep the
    suite's time."""
    env = toys.toy_process_env({**os.environ, "PYTHON": sys.executable})  # tiny shapes only
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_check.sh"), "--small", "--shapes", "tiny-llama",
         "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads((tmp_path / "device_check_cpu.json").read_text())
    assert (tmp_path / "device_check_cpu.png").stat().st_size > 0
    assert rep["small"] and rep["settings"]["budget"] == 300
    assert rep["complete"] and rep["skipped"] == [] and rep["failed"] == [], \
        (rep["skipped"], rep["failed"])
    assert rep["elapsed_s"] < 300
    assert rep["device"]["platform"] == "cpu" and rep["device"]["count"] >= 1
    assert rep["bandwidth"]["method"].startswith("host") and rep["bandwidth"]["GBps"] > 0
    law = rep["law"]
    assert law["passed"] and law["p_value"] > 1e-4 and law["control_p_value"] < 1e-6
    assert {p["name"] for p in rep["phases"]} == {"bandwidth", "law", "tiny-llama"}
    n_new = rep["settings"]["prompts"] * rep["settings"]["max_new_tokens"]
    s = rep["shapes"]["tiny-llama"]
    assert s["family"] == "Llama"
    _check_small_shape(s, n_new, device_check.ALL_METHODS)
    assert s["compile_wall_s"] > 0
    b = rep["shapes"]["tiny-llama"]["batched"]
    assert set(b) == {"ar", "eagle3:2,2,3", "sd-ngram:7"}
    for m, r in b.items():
        assert r["batch"] == 8 and r["rows_equal_to_ar"] == 8 and r["tokens_per_s"] > 0, m
        assert r["new_tokens"] == 8 * rep["settings"]["max_new_tokens"]

    # mtp's chain, as the full run's Gemma 4 shapes report it (its tree, mtp:5,4,16, in a
    # whole --small run: 20 s more of compiling here; Gemma 4 against transformers:
    # tests/test_gemma4.py)
    assert "mtp:3" in device_check._family_methods("Gemma4")
    out = tmp_path / "gemma4"
    rc = device_check.main(["--small", "--shapes", "tiny-gemma4", "--methods", "ar,mtp:3",
                            "--no-hf", "--law-rows", "0", "--batch", "1", "--widths", "1",
                            "--out", str(out)])
    rep = json.loads((out / "device_check_cpu.json").read_text())
    assert rc == 0 and rep["complete"], (rep["skipped"], rep["failed"])
    s = rep["shapes"]["tiny-gemma4"]
    assert s["family"] == "Gemma4" and "not_listed" not in s
    _check_small_shape(s, n_new, ("ar", "mtp:3"), widths={"1"}, hf=False)
    assert s["methods"]["mtp:3"]["spec"] == "mtp:3"


def _check_small_shape(s: dict, n_new: int, methods, widths=("1", "4", "16"),
                       hf: bool = True) -> None:
    wc = s["width_curve"]
    assert set(wc["ms"]) == set(widths) and all(v > 0 for v in wc["ms"].values())
    assert wc["relative_to_1"]["1"] == 1.0 and wc["filled"] < wc["capacity"]
    assert s["kernels_forward"]["kernels"] > 0 and s["kernels_forward"]["host_transfers"] == 0
    b = s["ar_vs_bound"]
    assert b["weight_bytes"] == s["weight_bytes"] > 0
    assert 0 < b["ar_fraction_of_bound"] and b["bound_tokens_per_s"] > 0
    if hf:
        assert s["hf"]["tokens_per_s"] > 0 and s["hf"]["new_tokens"] == n_new  # whole budget
    ms = s["methods"]
    assert set(ms) == set(methods), sorted(ms)
    for m in methods:
        r = ms[m]
        assert "error" not in r, (m, r)
        assert r["equal_to_ar"] is True and r["prompts_equal_to_ar"] == s["settings"]["prompts"]
        assert r["new_tokens"] == n_new and r["tokens_per_s"] > 0 and r["compile_s"] > 0
        assert r["ms_per_round"] > 0 and r["round_vs_ar_step"] > 0 and 1.0 <= r["tau"]
        assert r["kernels_per_round"] > 0 and r["host_transfers_in_loop"] == 0
        assert r["kernels"]["host_transfers_in_module"] == 0
    # a round of ar is one forward plus sampling; a speculative round drafts and verifies
    assert ms["ar"]["kernels_per_round"] >= s["kernels_forward"]["kernels"]
    for m in methods[1:]:
        assert ms[m]["kernels_per_round"] > ms["ar"]["kernels_per_round"], m
    if "hsd" in ms:
        assert ms["hsd"]["spec"].startswith("hsd:")
    assert ms["ar"]["round_vs_ar_step"] == 1.0
    assert s["settings"]["verify_widths"] == "auto" and s["settings"]["scan_layers"] is False
    assert s["matmul_precision"] == "highest"


def test_device_check_out_of_time_is_not_complete(tmp_path, capsys):
    """A budget too short for the shapes: the run says ``complete: false``, names what it
    skipped and why, and still exits 0 (nothing measured wrong)."""
    rc = device_check.main(["--small", "--budget", "0.3", "--law-rows", "0", "--shapes",
                            "tiny-llama", "--out", str(tmp_path)])
    rep = json.loads((tmp_path / "device_check_cpu.json").read_text())
    assert rc == 0 and rep["complete"] is False and rep["failed"] == []
    assert any("tiny-llama" in x and "out of time" in x for x in rep["skipped"]), rep["skipped"]
    assert "SKIPPED tiny-llama: ar (out of time)" in capsys.readouterr().out


def test_incomplete_lists_skips_errors_and_real_mismatches():
    res = {"phases": [{"name": "bandwidth", "status": "done"}],
           "law": {"passed": True, "p_value": 0.3, "control_p_value": 0.0},
           "shapes": {"s": {"width_curve": {"skipped": [64]},
                            "methods": {"ar": {"tokens_per_s": 1.0}, "skipped": ["hsd"],
                                        "eagle2:3,4,7": {"error": "boom"},
                                        "sd-ngram:7": {"real_mismatches": 1}},
                            "batched": {"skipped": ["ar"],
                                        "eagle3:3,4,7": {"rows_equal_to_ar": 7}},
                            "hf": {"not_applicable": "TPU host"}}}}
    skipped, failed = device_check.incomplete(res, 8)
    assert skipped == ["s: width 64 (not compiled within the budget)", "s: hsd (out of time)",
                       "s: ar at batch 8 (out of time)",
                       "s: eagle3:3,4,7 at batch 8: greedy divergence from ar not classified "
                       "(out of time)"]
    assert len(failed) == 2 and "boom" in failed[0] and "near tie" in failed[1]
    assert device_check.incomplete({"phases": [], "shapes": {}}, 8) == ([], [])
    res["law"]["passed"] = False
    assert "law check" in device_check.incomplete(res, 8)[1][0]


def test_settings_fill_the_small_and_full_defaults():
    small, full = device_check.settings(small=True, batch=None), device_check.settings()
    assert (small.budget, small.max_new_tokens, small.widths, small.capacity) == \
        (300.0, 16, "1,4,16", 128)
    assert (full.budget, full.max_new_tokens, full.widths, full.capacity) == \
        (520.0, 128, "1,8,16,32,64", 1024)
    assert small.batch == full.batch == 8 and 2 <= small.workers <= 12
    assert device_check.settings(small=True, max_new_tokens=4).max_new_tokens == 4
    # one tiny shape per family
    assert set(device_check._shapes(True)) == {"tiny-llama", "tiny-gemma", "tiny-gemma4"}


def test_shapes_take_their_family_and_its_methods_from_the_registries():
    """A shape's family is its config's registered one; ``all`` is every method drafting
    for that family (``Method.family`` None or the family's name), so ``mtp`` (Gemma 4's)
    runs on the Gemma 4 shapes only; the full Gemma 4 shapes run ar and every method
    drafting for Gemma 4 alone, in bfloat16."""
    from specjax import methods
    from specjax.models import gemma4

    small, full = device_check._shapes(True), device_check._shapes(False)
    fams = {n: device_check._family(s) for n, s in {**small, **full}.items()}
    assert fams == {"tiny-llama": "Llama", "tiny-gemma": "Gemma", "tiny-gemma4": "Gemma4",
                    "smollm2-135m": "Llama", "llama3.1-8b": "Llama", "gemma3-270m": "Gemma",
                    "gemma4-e4b": "Gemma4", "gemma4-31b": "Gemma4"}
    mtp = tuple(t for cls in methods.registered() if cls.family == "Gemma4"
                for t in cls.device)
    assert mtp == device_check._family_methods("Gemma4") and "mtp:3" in mtp
    anyone = device_check.ALL_METHODS
    assert anyone[0] == "ar" and "hsd" in anyone and not set(mtp) & set(anyone)
    assert device_check._all_methods("Gemma4") == anyone + mtp
    for name in ("tiny-llama", "tiny-gemma"):
        assert device_check._listed(small[name]) == list(anyone), name
    assert device_check._listed(small["tiny-gemma4"]) == list(anyone + mtp)
    for name, cfg in (("gemma4-e4b", gemma4.GEMMA4_E4B), ("gemma4-31b", gemma4.GEMMA4_31B)):
        s = full[name]
        assert s["cfg"] == cfg and s["dtype"] == s["compute"] == jnp.bfloat16
        assert device_check._listed(s) == ["ar", *mtp]
    assert list(full)[-1] == "gemma4-31b" and not full["gemma4-31b"]["hf"]
    assert full["gemma4-31b"]["workers"] <= 4 and full["gemma4-e4b"]["hf"]
    assert set(mtp) <= set(device_check.METHOD_ORDER)
    # --methods may name mtp where a Gemma 4 shape runs, not where none does
    opts = device_check.settings(small=True, shapes="tiny-llama", methods="ar,mtp:3")
    with pytest.raises(ValueError, match="mtp:3"):
        device_check.check_settings(opts)
    opts = device_check.settings(small=True, shapes="tiny-gemma4", methods="ar,mtp:3")
    assert list(device_check.check_settings(opts)) == ["tiny-gemma4"]


def test_transformers_peer_configs_read_back_as_the_shapes():
    """transformers' config of each shape's peer (``hf_config``) reads back through the
    family's own HF config parser as the shape's config (no weights made)."""
    import dataclasses

    from specjax.models import gemma4, gemma4_load, gemma_load, llama_load

    parsers = {"Llama": llama_load.hf_config, "Gemma": gemma_load.hf_gemma_config,
               "Gemma4": gemma4_load.hf_gemma4_config}
    shapes = {**device_check._shapes(True), **device_check._shapes(False),
              "moe": dict(cfg=gemma4.GEMMA4_26B_A4B)}
    for name, s in shapes.items():
        d = json.loads(device_check.hf_config(s).to_json_string())
        assert d["eos_token_id"] is None and d["bos_token_id"] is None, name
        assert parsers[device_check._family(s)](d) == s["cfg"], name
    with pytest.raises(ValueError, match="T5"):
        from specjax.models import t5

        device_check.hf_config(dict(cfg=dataclasses.replace(t5.T5_SMALL)))


def test_phase_seconds_split_what_remains_by_share():
    """The 8B shape and SmolLM2 each get two fifths of a full run, Gemma one fifth; what a
    phase leaves unused goes to the shapes after it; a subset shares all the time left."""
    all3 = ["smollm2-135m", "llama3.1-8b", "gemma3-270m"]
    assert device_check.phase_seconds("smollm2-135m", all3, 500.0) == pytest.approx(200.0)
    assert device_check.phase_seconds("llama3.1-8b", all3[1:], 300.0) == pytest.approx(200.0)
    assert device_check.phase_seconds("gemma3-270m", all3[2:], 120.0) == pytest.approx(120.0)
    assert device_check.phase_seconds("llama3.1-8b", ["llama3.1-8b"], 200.0) == 200.0
    assert device_check.phase_seconds("tiny-llama", ["tiny-llama", "tiny-gemma"], 10.0) == 5.0
    assert device_check.phase_seconds("smollm2-135m", all3, -3.0) == 0.0
