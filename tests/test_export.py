"""Exported draft heads (``specjax.heads.exported``): safetensors + ``head.json`` round
trips exactly, loads in another process onto 8 devices (default device, replicated or
sharded on a mesh), legacy Orbax heads saved on another device load, bad files fail with
``CheckpointError``; resumable training checkpoints saved on another device restore too."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import toys
from specjax import methods
from specjax.drafters import eagle, exit_heads, redrafter
from specjax.heads import exported
from specjax.train import checkpoint

ROOT = Path(__file__).resolve().parent.parent
TOY = toys.LLAMA


def _head(seed: int = 0) -> dict:
    """A toy EAGLE head with values that bfloat16 cannot hold exactly."""
    h = eagle.init_head(TOY, jax.random.key(seed))
    return jax.tree.map(lambda x: x + jax.random.normal(jax.random.key(seed + 1), x.shape), h)


def _bits(tree) -> dict:
    """Every leaf's dtype, shape and bytes, by name: equal iff the trees are bitwise equal."""
    return {k: (str(v.dtype), v.shape, v.tobytes())
            for k, v in exported.flatten(jax.tree.map(np.asarray, tree)).items()}


def _bf16(tree):
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), tree)


# ----------------------------------------------------------------------------- names

def test_names_round_trip_every_container_kind():
    tree = {"a": [np.ones((2, 3), np.float32), (np.arange(3), {"x": np.float32(1.5)})],
            "b": {3: {"w": np.zeros(2)}, -1: np.ones(1)}, "4": {"b": np.ones(1)}}
    flat = exported.flatten(tree)
    assert sorted(flat) == sorted(["a/[0]", "a/[1]/(0)", "a/[1]/(1)/x", "b/#3/w", "b/#-1", "4/b"])
    back = exported.unflatten(flat)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    assert type(back["a"]) is list and type(back["a"][1]) is tuple
    assert set(back["b"]) == {3, -1} and set(back) == {"a", "b", "4"}  # "4" stays a string
    assert _bits(back) == _bits(tree)


@pytest.mark.parametrize("bad", [{"a/b": np.ones(1)}, {"#1": np.ones(1)}, {"": np.ones(1)},
                                 {"a": None}, {"a": {}}, {1.5: np.ones(1)}, np.ones(2)])
def test_trees_the_names_cannot_rebuild_are_refused(bad):
    with pytest.raises(ValueError):
        exported.flatten(bad)


@pytest.mark.parametrize("make", [
    lambda: eagle.init_head(TOY, jax.random.key(0)),
    lambda: exit_heads.init_heads(TOY, (1, 2), jax.random.key(0), rank=4),
    lambda: redrafter.init_head(16, 32, jax.random.key(0), blocks=2),  # int-keyed blocks
    lambda: redrafter.exportable(redrafter.init_head(16, 32, jax.random.key(0), blocks=2)),
], ids=["eagle", "exit-heads", "redrafter", "redrafter-exportable"])
def test_every_head_kind_keeps_its_tree(make, tmp_path):
    head = make()
    out = exported.export_head(head, tmp_path / "h", {"kind": "k"})
    back, meta = exported.load_head(out, "k", like=head)
    assert jax.tree.structure(back) == jax.tree.structure(head)
    assert _bits(back) == _bits(_bf16(head))
    assert meta["shapes"] == json.loads(json.dumps(jax.tree.map(lambda x: list(x.shape), head)))


# ----------------------------------------------------------------------------- values

def test_bfloat16_round_trip_is_exact_and_other_dtypes_are_kept(tmp_path):
    head = {**_head(), "ids": jnp.arange(5, dtype=jnp.int32)}
    out = exported.export_head(head, tmp_path / "h", {"kind": "eagle", "note": [1, "x"]})
    assert sorted(p.name for p in out.iterdir()) == ["head.json", "params.safetensors"]
    back, meta = exported.load_head(out, "eagle")
    assert back["fc"].dtype == jnp.bfloat16 and back["ids"].dtype == jnp.int32
    assert _bits(back) == _bits({**_bf16(_head()), "ids": head["ids"]})
    assert meta["note"] == [1, "x"] and meta["dtypes"] == {"float": "bfloat16"}
    f32 = exported.export_head(head, tmp_path / "f", {"kind": "eagle"}, dtype=jnp.float32)
    assert _bits(exported.load_head(f32, "eagle")[0]) == _bits(head)


def test_the_file_is_plain_safetensors(tmp_path):
    """Any safetensors reader sees the parameters by their names, in bfloat16."""
    from safetensors import safe_open

    out = exported.export_head(_head(), tmp_path / "h", {"kind": "eagle"})
    with safe_open(out / exported.PARAMS, framework="np") as f:
        assert f.metadata() == exported.FORMAT
        assert set(f.keys()) == set(exported.flatten(_head()))
        np.testing.assert_array_equal(f.get_tensor("layer/qkv").view(np.uint16),
                                      np.asarray(_bf16(_head())["layer"]["qkv"]).view(np.uint16))


def test_export_replaces_a_head_but_not_other_directories(tmp_path):
    out = exported.export_head(_head(0), tmp_path / "h", {"kind": "eagle"})
    (out / exported.LEGACY_PARAMS).mkdir()  # a legacy checkpoint there is replaced too
    exported.export_head(_head(5), out, {"kind": "eagle"})
    assert _bits(exported.load_head(out, "eagle")[0]) == _bits(_bf16(_head(5)))
    assert not (out / exported.LEGACY_PARAMS).exists()
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    with pytest.raises(exported.CheckpointError, match="not an exported head"):
        exported.export_head(_head(), other, {"kind": "eagle"})
    assert (other / "todo.txt").read_text() == "keep me"


# ----------------------------------------------------------------------------- errors

def test_bad_heads_fail_with_checkpoint_errors(tmp_path):
    head = _head()
    out = exported.export_head(head, tmp_path / "h", {"kind": "eagle"})
    with pytest.raises(exported.CheckpointError, match="not an exported head"):
        exported.load_head(tmp_path, "eagle")
    with pytest.raises(exported.CheckpointError, match="not 'redrafter'"):
        exported.load_head(out, "redrafter")
    big = eagle.init_head(dataclasses.replace(TOY, hidden_size=24), jax.random.key(0))
    with pytest.raises(exported.CheckpointError, match="another model.*fc"):
        exported.load_head(out, "eagle", like=big)
    fewer = {k: v for k, v in head.items() if k != "fc_b"}
    with pytest.raises(exported.CheckpointError, match="another model.*fc_b"):
        exported.load_head(out, "eagle", like=fewer)

    data = (out / exported.PARAMS).read_bytes()
    for broken in (data[:len(data) // 2], data[:5], b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage",
                   b""):
        (out / exported.PARAMS).write_bytes(broken)
        with pytest.raises(exported.CheckpointError, match="corrupt or truncated"):
            exported.load_head(out, "eagle", like=head)
    (out / exported.PARAMS).unlink()
    with pytest.raises(exported.CheckpointError, match="no parameters"):
        exported.load_head(out, "eagle")
    (out / "head.json").write_text("{not json")
    with pytest.raises(exported.CheckpointError, match="corrupt"):
        exported.load_head(out, "eagle")


# ----------------------------------------------------------------------------- placement

CHILD = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    from specjax import sharding
    from specjax.heads import exported
    assert len(jax.devices()) == 8, jax.devices()
    want = dict(np.load(sys.argv[2]))
    def same(params):
        flat = exported.flatten(jax.tree.map(np.asarray, params))
        assert set(flat) == set(want), (set(flat), set(want))
        for k, v in flat.items():
            assert v.dtype.name == "bfloat16" and v.view(np.uint16).tobytes() == want[k].tobytes(), k
    params, _ = exported.load_head(sys.argv[1], "eagle")
    same(params)
    for x in jax.tree.leaves(params):
        assert x.sharding.device_set == {jax.devices()[0]} and not x.committed, x.sharding
    mesh = sharding.make_mesh(data=2, model=4)
    params, _ = exported.load_head(sys.argv[1], "eagle", mesh=mesh)
    same(params)
    for x in jax.tree.leaves(params):
        assert x.sharding.device_set == set(jax.devices()) and x.sharding.is_fully_replicated
    specs = jax.tree.map(lambda x: P(), params)
    specs["fc"] = P(None, "model")
    params, _ = exported.load_head(sys.argv[1], "eagle", mesh=mesh, specs=specs)
    same(params)
    fc = params["fc"]
    assert fc.sharding.device_set == set(jax.devices()) and not fc.sharding.is_fully_replicated
    assert {s.data.shape for s in fc.addressable_shards} == {(fc.shape[0], fc.shape[1] // 4)}
    print("OK")
""")


def test_a_head_loads_in_another_process_on_8_devices(tmp_path):
    head = _head()
    out = exported.export_head(head, tmp_path / "h", {"kind": "eagle"})
    np.savez(tmp_path / "want.npz", **{k: v.view(np.uint16) for k, v in
                                       exported.flatten(jax.tree.map(np.asarray, _bf16(head))).items()})
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    run = subprocess.run([sys.executable, "-c", CHILD, str(out), str(tmp_path / "want.npz")],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stderr[-3000:]


# ----------------------------------------------------------------------------- Orbax

def _saved_on_cuda(ckpt_dir: Path) -> None:
    """Rewrites the devices an Orbax checkpoint records as if it were saved on a GPU."""
    files = list(ckpt_dir.rglob("_sharding"))
    assert files, f"no _sharding file under {ckpt_dir}"
    for f in files:
        text = f.read_text()
        assert "cpu:0" in text
        f.write_text(text.replace("cpu:0", "cuda:0"))


def test_a_legacy_orbax_head_saved_on_a_gpu_loads(tmp_path):
    head = _bf16(_head())
    out = tmp_path / "legacy"
    out.mkdir()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(out / "params", head)
    (out / "head.json").write_text(json.dumps({"kind": "eagle", "shapes": jax.tree.map(
        lambda x: list(x.shape), head)}))
    _saved_on_cuda(out / "params")
    with ocp.StandardCheckpointer() as ckpt, pytest.raises(ValueError, match="[Tt]opology"):
        ckpt.restore(out / "params")  # what load_head used to do: the bug this guards
    for like in (None, head):
        back, meta = exported.load_head(out, "eagle", like=like)
        assert _bits(back) == _bits(head) and meta["kind"] == "eagle"
    for f in (out / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "ocdbt" in str(f):
            f.write_bytes(b"\0garbage")
    with pytest.raises(exported.CheckpointError, match="corrupt"):
        exported.load_head(out, "eagle")


def test_a_training_checkpoint_saved_on_a_gpu_restores(tmp_path):
    state = {"params": _head(), "opt_state": (jnp.zeros(3), {"mu": jnp.ones(2)}),
             "step": jnp.asarray(7, jnp.int32)}
    with checkpoint.manager(tmp_path) as mngr:
        mngr.save(7, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
    _saved_on_cuda(tmp_path / "ckpt" / "7")
    checkpoint.write_manifest(tmp_path / "ckpt" / "7")  # as the GPU run wrote it
    like = jax.tree.map(jnp.zeros_like, state)
    with checkpoint.manager(tmp_path) as mngr:
        step, back = checkpoint.restore_latest(mngr, like)
    assert step == 7 and _bits(back) == _bits(state)


# ----------------------------------------------------------------------------- shipped

SHIPPED = sorted(p for p in (ROOT / "specjax" / "heads").iterdir() if p.is_dir())


@pytest.mark.parametrize("head", SHIPPED, ids=lambda p: p.name)
def test_shipped_heads_are_safetensors_and_load(head):
    assert sorted(p.name for p in head.iterdir()) == ["head.json", "params.safetensors"]
    meta = json.loads((head / "head.json").read_text())
    params, meta2 = exported.load_head(head, meta["kind"])
    assert meta2 == meta
    assert json.loads(json.dumps(jax.tree.map(lambda x: list(x.shape), params))) == meta["shapes"]
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(meta["dtypes"]["float"])}


def test_no_redrafter_head_ships_and_the_error_gives_the_recipe():
    from specjax.heads import shipped

    assert not shipped.SHIPPED["redrafter"]
    assert shipped.shipped_head("redrafter", "smollm2-135m") is None

    class LM:  # load_drafter looks for a head before it reads the model's config
        model = SimpleNamespace(config=None)
        params = None

    with pytest.raises(FileNotFoundError, match="train redrafter.*--export DIR.*"
                                                "--redrafter-checkpoint DIR"):
        methods.load_drafter("redrafter", LM(), "smollm2-135m")
