"""The prepared accelerator check (``scripts/device_check.sh``, ``specjax.device_check``)
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

from specjax import device_check

ROOT = Path(__file__).resolve().parent.parent


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
    s = device_check.hlo_stats(jax.jit(decode).lower(x, 3).compile().as_text())
    assert s["host_transfers_in_module"] == 0
    r = s["round"]
    assert r["conditionals"] == 1 and r["host_transfers"] == 0 and r["kernels"] >= 2
    assert s["program"]["whiles"] >= 1 and s["program"]["kernels"] > r["kernels"]
    cb = device_check.hlo_stats(jax.jit(with_callback).lower(x).compile().as_text())
    assert cb["round"]["host_transfers"] >= 1 and cb["host_transfers_in_module"] >= 1
    fwd = device_check.hlo_stats(jax.jit(lambda x: jnp.tanh(x @ x).sum()).lower(x)
                                 .compile().as_text())
    assert fwd["round"] is None and fwd["program"]["kernels"] >= 1


def test_opcode_of_tuple_typed_instructions():
    line = ("  %w = (f32[2]{0}, s32[]) while(%t), condition=%c, body=%b, "
            'backend_config={"known_trip_count":{"n":"7"}}')
    assert device_check._opcode(line) == "while"
    assert device_check._opcode("  ROOT %a.1 = f32[2]{0} add(%x, %y)") == "add"
    comps = {"e": [("while", line)], "b": [("fusion", "  %f = f32[] fusion(%p)")],
             "c": [("fusion", "  %g = pred[] fusion(%p)")]}
    c = device_check.count(comps, "e")
    assert c.whiles == 1 and c.fusions == 7 + 8 and c.kernels == 15  # body 7x, condition 8x


def test_device_check_small_runs_every_method_equal_to_ar(tmp_path):
    """``bash scripts/device_check.sh --small`` on this CPU: the accelerator code path on a
    tiny random Llama, every method's greedy output equal to ar's, every field present."""
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_check.sh"), "--small", "--shapes",
         "tiny-llama", "--budget", "400", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads((tmp_path / "device_check_cpu.json").read_text())
    assert (tmp_path / "device_check_cpu.png").stat().st_size > 0
    assert rep["complete"] and rep["small"]
    assert rep["device"]["platform"] == "cpu" and rep["device"]["count"] >= 1
    assert rep["bandwidth"]["method"].startswith("host") and rep["bandwidth"]["GBps"] > 0
    s = rep["shapes"]["tiny-llama"]
    wc = s["width_curve"]
    assert set(wc["ms"]) == {"1", "4", "16"} and all(v > 0 for v in wc["ms"].values())
    assert wc["relative_to_1"]["1"] == 1.0 and wc["filled"] < wc["capacity"]
    assert s["kernels_forward"]["kernels"] > 0 and s["kernels_forward"]["host_transfers"] == 0
    b = s["ar_vs_bound"]
    assert b["weight_bytes"] == s["weight_bytes"] > 0
    assert 0 < b["ar_fraction_of_bound"] and b["bound_tokens_per_s"] > 0
    n_new = rep["settings"]["prompts"] * rep["settings"]["max_new_tokens"]
    hf = s["hf"]
    assert hf["tokens_per_s"] > 0 and hf["new_tokens"] == n_new  # no EOS: whole budget
    ms = s["methods"]
    assert set(device_check.ALL_METHODS) <= set(ms), sorted(ms)
    for m in device_check.ALL_METHODS:
        r = ms[m]
        assert "error" not in r, (m, r)
        assert r["equal_to_ar"] is True and r["prompts_equal_to_ar"] == rep["settings"]["prompts"]
        assert r["new_tokens"] == n_new and r["tokens_per_s"] > 0 and r["compile_s"] > 0
        assert r["ms_per_round"] > 0 and r["round_vs_ar_step"] > 0 and 1.0 <= r["tau"]
        assert r["kernels_per_round"] > 0 and r["host_transfers_in_loop"] == 0
        assert r["kernels"]["host_transfers_in_module"] == 0
    # a round of ar is one forward plus sampling; a speculative round drafts and verifies
    assert ms["ar"]["kernels_per_round"] >= s["kernels_forward"]["kernels"]
    for m in device_check.ALL_METHODS[1:]:
        assert ms[m]["kernels_per_round"] > ms["ar"]["kernels_per_round"], m
    assert ms["hsd"]["spec"].startswith("hsd:") and ms["ar"]["round_vs_ar_step"] == 1.0
    assert {p["name"] for p in rep["phases"]} == {"bandwidth", "tiny-llama"}
    assert s["settings"]["verify_widths"] == "auto" and s["settings"]["scan_layers"] is False
    assert s["matmul_precision"] == "highest"
