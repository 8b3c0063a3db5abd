"""Loading an HF checkout tensor by tensor (``specjax.models.load(..., mesh=)``): host memory
stays near the weights' size, each device of a mesh receives only its slice, values equal
an independent float32 reading, and only the files transformers reads are read.

The memory tests load a random 0.53 GB bfloat16 Llama checkout in 4 shards in fresh
processes (``scripts/load_bench.py``), one without a mesh and one onto a 1x8 mesh of 8
simulated CPU devices, both at once; the mesh-vs-one-device greedy test runs in a third
process with 8 devices (JAX fixes its device count when it starts).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import sharding
from specjax.models import WeightLoadError, load_hf_dir

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("load_bench", ROOT / "scripts" / "load_bench.py")
load_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(load_bench)

# 8 query heads split over model=8; 4 KV heads do not, and stay replicated
TINY = dict(hidden=64, intermediate=128, vocab=256, heads=8, kv_heads=4)


# ----------------------------------------------------------------- memory (fresh processes)

@pytest.fixture(scope="module")
def big_runs(tmp_path_factory):
    """(file bytes, {mode: report}) of loading a 12-layer, 0.53 GB bfloat16 checkout."""
    path = tmp_path_factory.mktemp("big_checkout")
    nbytes = load_bench.write_checkout(path, layers=12, shards=4)
    assert nbytes >= 0.5e9
    procs = {m: load_bench.start(path, m) for m in ("specjax", "specjax-mesh")}
    return nbytes, {m: load_bench.result(p) for m, p in procs.items()}


@pytest.mark.parametrize("mode", ["specjax", "specjax-mesh"])
def test_peak_host_memory_stays_near_the_file_size(big_runs, mode):
    """Peak RSS above the post-import baseline is at most 1.5x the safetensors bytes (the
    devices are host memory on CPU, so the loaded weights alone are 1.0x; reading every
    tensor into float32 first peaked at 3.7x)."""
    nbytes, runs = big_runs
    r = runs[mode]
    ratio = r["peak_over_baseline_bytes"] / nbytes
    print(f"{mode}: peak {ratio:.2f}x of {nbytes / 1e9:.2f} GB, {r['wall_s']} s")
    assert r["weights_bytes"] >= 0.99 * nbytes  # everything was loaded, in bfloat16
    assert ratio <= 1.5, f"{mode}: peak RSS {ratio:.2f}x the file bytes"


def test_each_device_of_a_model_mesh_holds_its_slice(big_runs):
    """On a data=1, model=8 mesh no device holds more than a quarter of the weights."""
    _, runs = big_runs
    r = runs["specjax-mesh"]
    per_device = r["per_device_bytes"]
    assert len(per_device) == 8
    worst = max(per_device.values()) / r["weights_bytes"]
    print(f"largest device share {worst:.3f}")
    assert worst <= 0.25, per_device


# ----------------------------------------------------------------- values (this process)

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_checkout")
    load_bench.write_checkout(path, layers=2, shards=3, seed=1, **TINY)
    return path


def _reference_flat(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a sharded checkout in float32, read by safetensors' torch reader."""
    import torch
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("model-*.safetensors")):
        out.update({k: v.to(torch.float32).numpy() for k, v in load_file(str(f)).items()})
    return out


def _reference(path: Path) -> dict:
    """The params of a sharded checkout read independently (:func:`_reference_flat`), q/k/v
    and gate/up concatenated by rows."""
    t = _reference_flat(path)
    n = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    layers = []
    for i in range(n):
        g = lambda s: t[f"model.layers.{i}.{s}.weight"]  # noqa: E731
        layers.append({"attn_norm": g("input_layernorm"), "mlp_norm": g("post_attention_layernorm"),
                       "qkv": np.concatenate([g("self_attn.q_proj"), g("self_attn.k_proj"),
                                              g("self_attn.v_proj")]),
                       "o": g("self_attn.o_proj"), "down": g("mlp.down_proj"),
                       "gate_up": np.concatenate([g("mlp.gate_proj"), g("mlp.up_proj")])})
    return {"embed": t["model.embed_tokens.weight"], "final_norm": t["model.norm.weight"],
            "lm_head": t["lm_head.weight"], "layers": layers}


def _assert_same(got, want, dtype):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(jnp.asarray(w, dtype)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_loaded_params_equal_a_float32_reading(tiny, dtype):
    """bfloat16 shards load exactly, as bfloat16 or widened to float32; without a mesh in
    the fused layout, stacked for ``scan_layers`` as ``llama.stack_layers`` stacks."""
    from specjax.models import llama

    ref = _reference(tiny)
    _, params = load_hf_dir(tiny, dtype)
    _assert_same(params, ref, dtype)
    _, stacked = load_hf_dir(tiny, dtype, stacked=True)
    _assert_same(stacked, llama.stack_layers(jax.tree.map(np.asarray, ref)), dtype)


def test_float32_shards_cast_like_jax(tmp_path, tiny):
    """A float32 checkout loaded as bfloat16 equals JAX's cast of the float32 values (fused
    matrices included), not a truncation."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {k: (v * (1 + rng.standard_normal(v.shape) * 1e-3)).astype(np.float32)
               for k, v in _reference_flat(tiny).items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny / "config.json").read_text())
    _, got = load_hf_dir(tmp_path, jnp.bfloat16)
    qkv = np.concatenate([tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    for ours, want in [(got["layers"][1]["qkv"], qkv),
                       (got["embed"], tensors["model.embed_tokens.weight"])]:
        assert ours.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(jnp.asarray(want, jnp.bfloat16)))


def test_mesh_load_places_like_shard_params(tiny):
    """With a (one-device) mesh the params and their shardings are ``shard_params``'s, for
    per-layer and stacked weights; a mesh the heads do not split over fails before reading."""
    mesh = sharding.make_mesh(1, 1)
    cfg, plain = load_hf_dir(tiny)
    for stacked in (False, True):
        _, placed = load_hf_dir(tiny, mesh=mesh, stacked=stacked)
        _, base = load_hf_dir(tiny, stacked=stacked)
        want = sharding.shard_params(cfg, base, mesh)
        assert jax.tree.structure(placed) == jax.tree.structure(want)
        for g, w in zip(jax.tree.leaves(placed), jax.tree.leaves(want)):
            assert g.sharding == w.sharding
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    lm = specjax.models.load(str(tiny), tokenizer=False, mesh=mesh)
    assert lm.mesh is mesh and "q" in lm.params["layers"][0]
    fake = type("M", (), {"shape": {"data": 1, "model": 3}})()
    with pytest.raises(ValueError, match="does not divide"):
        specjax.models.load(str(tiny), tokenizer=False, mesh=fake)


# ----------------------------------------------------------------- which files are read

def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _merge(src: Path, dst: Path, name: str = "model.safetensors", scale: float = 1.0) -> Path:
    """``src``'s shards as one float32 file ``dst/name`` (values times ``scale``)."""
    from safetensors.numpy import save_file

    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v * scale for k, v in _reference_flat(src).items()}, str(dst / name))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_a_stray_safetensors_file_is_ignored(tiny, tmp_path):
    """As transformers: ``model.safetensors`` (or the index's shards) are the weights; a
    ``model_backup.safetensors`` beside them changes nothing, whatever its name sorts as."""
    ref = jax.tree.map(np.asarray, load_hf_dir(tiny)[1])
    d = _merge(tiny, tmp_path / "single")
    _merge(tiny, d, "model_backup.safetensors", scale=2.0)
    _merge(tiny, d, "a_backup.safetensors", scale=3.0)
    _assert_same(load_hf_dir(d)[1], ref, jnp.float32)
    s = _copy(tiny, tmp_path / "sharded")
    _merge(tiny, s, "model_backup.safetensors", scale=2.0)
    _assert_same(load_hf_dir(s)[1], ref, jnp.float32)


def test_other_weight_files_without_an_index(tiny, tmp_path):
    """Without ``model.safetensors`` or an index, one other safetensors file is the
    weights, and several are refused, named."""
    d = _merge(tiny, tmp_path / "one", "weights.safetensors")
    _assert_same(load_hf_dir(d)[1], jax.tree.map(np.asarray, load_hf_dir(tiny)[1]), jnp.float32)
    _merge(tiny, d, "other.safetensors", scale=2.0)
    with pytest.raises(WeightLoadError, match=r"several weight files \['other.safetensors', "
                                              r"'weights.safetensors'\]"):
        load_hf_dir(d)


def test_an_index_naming_a_missing_shard_is_one_clear_line(tiny, tmp_path):
    d = _copy(tiny, tmp_path / "m")
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(WeightLoadError) as e:
        load_hf_dir(d)
    msg = str(e.value)
    assert "\n" not in msg and "model-00002-of-00003.safetensors, which is missing" in msg


def test_index_and_shards_that_disagree_or_break_are_refused(tiny, tmp_path):
    d = _copy(tiny, tmp_path / "m")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "model.layers.0.mlp.up_proj.weight"
    index["weight_map"][name] = "model-00003-of-00003.safetensors" if (
        index["weight_map"][name] != "model-00003-of-00003.safetensors") else \
        "model-00001-of-00003.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightLoadError, match=f"puts '{name}' in"):
        load_hf_dir(d)
    d = _copy(tiny, tmp_path / "t")
    f = d / "model-00003-of-00003.safetensors"
    f.write_bytes(f.read_bytes()[:-100])  # truncated
    with pytest.raises(WeightLoadError, match="not a readable safetensors file"):
        load_hf_dir(d)


# ----------------------------------------------------------------- greedy on 8 devices

PROMPTS = [[1, 5, 2, 7, 5, 9], [3, 3, 1, 4], [7, 2, 7, 2, 7, 9, 11, 2], [5, 6]]

_GREEDY = r"""
import json, sys
import specjax
from specjax import sharding
out = {}
for name, shape, scan in [("model=8", (1, 8), False), ("data=2,model=4,scan", (2, 4), True)]:
    mesh = sharding.make_mesh(*shape)
    lm = specjax.models.load(sys.argv[1], tokenizer=False, mesh=mesh, scan_layers=scan)
    assert lm.mesh is mesh
    q = lm.params["layers"]["q"] if scan else lm.params["layers"][0]["q"]
    assert len({str(s.index) for s in q.addressable_shards}) == shape[1], q.sharding
    res = specjax.generate(lm.model, lm.params, json.loads(sys.argv[2]), max_new_tokens=12,
                           mesh=mesh)
    out[name] = res.to_lists()
print("RESULT " + json.dumps(out))
"""


def test_greedy_on_a_mesh_load_equals_the_one_device_load(tiny):
    """Loaded straight onto 8 simulated devices (model=8; data=2,model=4 with scan_layers,
    in a process of its own), with the weights split over ``model``, greedy decoding equals
    the one-device load's (decoded here meanwhile)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                        + " --xla_force_host_platform_device_count=8").strip()
    proc = subprocess.Popen([sys.executable, "-c", _GREEDY, str(tiny), json.dumps(PROMPTS)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lm = specjax.models.load(str(tiny), tokenizer=False)
    one = specjax.generate(lm.model, lm.params, PROMPTS, max_new_tokens=12).to_lists()
    out, err = proc.communicate(timeout=300)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, err[-3000:]
    assert all(len(r) == 12 for r in one)
    assert len({t for r in one for t in r}) > 4  # not a degenerate rollout
    for name, rows in json.loads(lines[-1][len("RESULT "):]).items():
        assert rows == one, name
