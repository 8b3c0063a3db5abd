"""Loading onto a mesh that spans processes reads, in each process, only the rows of the
checkpoint that its own devices hold, and places the same values as a one-process load.

In this process: a block of a leaf built alone (``streaming._build`` with a region, as
``loading.placer`` asks for it) equals that block of the whole leaf bit for bit, and reads
only the block's rows, counted through the source: safetensors per layer and stacked,
fused and split, and SmolLM2's GGUF (Q4_1, Q8_0 and F32 tensors; Q/K, which llama.cpp
permutes, are read whole). Then two processes of 2 simulated CPU devices each
(``specjax.distributed.launch``) load a tiny checkout onto ``model=4``: each reads exactly
its half of every row-split tensor and the whole of the others, and every shard it holds
equals the one-process load's.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import loading, streaming
from specjax.models.gguf_source import open_gguf

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("load_bench", ROOT / "scripts" / "load_bench.py")
load_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(load_bench)

# 8 query heads and 4 KV heads: every row-split weight splits over model=4
TINY = dict(hidden=64, intermediate=128, vocab=256, heads=8, kv_heads=4)


class Counting(loading.TensorSource):
    """``src``, counting the rows of each tensor read (elements of a 1-D one)."""

    def __init__(self, src: loading.TensorSource):
        self.src, self.shapes, self.rows = src, src.shapes, collections.Counter()

    def read(self, name, rows=None):
        out = self.src.read(name, rows)
        self.rows[name] += out.shape[0]
        return out

    def read_into(self, name, out, rows=None):
        self.src.read_into(name, out, rows)
        self.rows[name] += out.shape[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_checkout")
    load_bench.write_checkout(path, layers=3, shards=2, seed=2, **TINY)
    return path


def _regions(shape, stacked):
    """Blocks to build: the second half of the rows (a process holding 2 of 4 row shards),
    rows crossing fused parts' boundaries, the second half of the columns (all rows read)
    and, stacked, one layer. Each with the rows a correct build reads per layer."""
    lead = (slice(0, shape[0]),) if stacked else ()
    body = shape[len(lead):]
    whole = tuple(slice(0, n) for n in body)
    r = body[0]
    out = [(lead + (slice(r // 2, r),) + whole[1:], r - r // 2),
           (lead + (slice(r // 3, r - r // 5),) + whole[1:], r - r // 5 - r // 3)]
    if len(body) == 2:
        out.append((lead + (whole[0], slice(body[1] // 2, body[1])), r))
    if stacked:
        out.append(((slice(1, 2),) + whole, r))
    return out


def _bits(x):
    return np.ascontiguousarray(x).view(np.uint8)


def _check_blocks(src, cfg, found, stacked, split, dtype, keep=lambda path: True):
    for path, parts in streaming._leaves(cfg, found, split=split, stacked=stacked):
        if not keep(path):
            continue
        st = stacked and path[0] == "layers"
        whole = streaming._build(src, cfg, parts, st, dtype)
        assert whole.shape == streaming._leaf_shape(src, parts, st)
        for region, rows in _regions(whole.shape, st):
            counting = Counting(src)
            block = streaming._build(counting, cfg, parts, st, dtype, region)
            assert block.dtype == whole.dtype
            np.testing.assert_array_equal(_bits(block), _bits(whole[region]), err_msg=str(path))
            layers = (region[0].stop - region[0].start) if st else 1
            permuted = any(fn is not streaming.same for p in parts for _, fn in p)
            if not permuted:
                assert sum(counting.rows.values()) == rows * layers, (path, region)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("stacked", [False, True])
def test_a_safetensors_block_reads_only_its_rows(tiny, stacked, dtype):
    cfg = loading.hf_dir_config(tiny)
    src = loading.SafetensorsSource(loading.hf_weight_table(tiny))
    found = loading.check_names(cfg, src.shapes, loading.HF_KEYS, str(tiny))
    for split in (False, True):
        _check_blocks(src, cfg, found, stacked, split, jnp.dtype(dtype))


def test_a_gguf_block_dequantizes_only_its_rows():
    """SmolLM2's Q8_0 embedding, Q4_1 matrices and F32 norms; its Q and K are permuted
    after dequantizing, so they are read whole, and their blocks still match."""
    from specjax.models.registry import resolve

    reader = open_gguf(resolve("smollm2-135m"))
    cfg = loading.gguf_config(reader)
    src = loading.GGUFSource(reader)
    found = loading.check_names(cfg, src.shapes, loading.GGUF_KEYS, "smollm2")
    for name in ("token_embd.weight", "blk.3.ffn_gate.weight", "blk.3.attn_output.weight"):
        full = src.read(name)
        np.testing.assert_array_equal(src.read(name, (100, 161)), full[100:161])
    keep = {("embed",), ("layers", 2, "q"), ("layers", 2, "gate"), ("layers", 2, "down"),
            ("layers", 2, "attn_norm")}
    _check_blocks(src, cfg, found, False, True, jnp.dtype(jnp.float32), keep.__contains__)
    _check_blocks(src, cfg, found, True, True, jnp.dtype(jnp.bfloat16),
                  lambda p: p in {("layers", "k"), ("layers", "v")})


def test_local_region_covers_the_slices_given():
    shape = (2, 12, 6)
    got = loading.local_region(shape, [(slice(None), slice(3, 6), slice(None)),
                                       (slice(None), slice(6, 9), slice(None))])
    assert got == (slice(0, 2), slice(3, 9), slice(0, 6))
    assert loading.local_region((5,), [(slice(None),)]) == (slice(0, 5),)


# ----------------------------------------------------------------- two processes

_CHILD = r"""
import json, sys
from specjax import distributed
distributed.initialize(distributed.Settings(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
import jax, numpy as np
from specjax import sharding
from specjax.models import llama, loading

read = []
_orig = loading.SafetensorsSource._read_bytes
def _counted(self, t, at, buf):
    read.append(buf.nbytes)
    _orig(self, t, at, buf)
loading.SafetensorsSource._read_bytes = _counted

path = sys.argv[1]
cfg, plain = loading.load_hf_dir(path)  # on this process's first device
ref = sharding.split_layout(cfg, jax.tree.map(np.asarray, plain))
out = {}
for name, shape, stacked in [("model=4", (1, 4), False), ("model=4,scan", (1, 4), True),
                             ("data=2,model=2", (2, 2), False)]:
    read.clear()
    _, params = loading.load_hf_dir(path, mesh=sharding.make_mesh(*shape), stacked=stacked)
    want = llama.stack_layers(ref) if stacked else ref
    got, exp = jax.tree.leaves(params), jax.tree.leaves(want)
    same = len(got) == len(exp) and all(
        np.array_equal(np.asarray(s.data), np.asarray(w)[s.index])
        for g, w in zip(got, exp) for s in g.addressable_shards)
    out[name] = {"bytes_read": sum(read), "same": same,
                 "shards": sum(len(g.addressable_shards) for g in got)}
print("RESULT " + json.dumps(out))
"""


def test_two_processes_read_their_halves_and_place_the_same_values(tiny, tmp_path):
    """model=4 over 2 processes x 2 devices: each process reads half of every row-split
    tensor (Q, K, V, gate, up, embedding, LM head) and the whole of the others (norms, and
    o and down, split by columns), per layer and stacked; on data=2,model=2 each process
    holds every model shard and reads everything. Every shard equals the one-process
    load's."""
    from specjax import distributed

    c = json.loads((tiny / "config.json").read_text())
    split_rows = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens",
                  "lm_head")
    nbytes = {n: 2 * int(np.prod(s)) for n, s in load_bench.tensor_shapes(c).items()}
    half = sum(b // 2 if any(k in n for k in split_rows) else b for n, b in nbytes.items())
    results = distributed.launch(
        [sys.executable, "-c", _CHILD, str(tiny), "{coordinator}", "{num_processes}",
         "{process_id}"], 2, devices=2, timeout=240, log_dir=tmp_path / "logs")
    for r in results:
        lines = [ln for ln in r.output.splitlines() if ln.startswith("RESULT ")]
        assert r.returncode == 0 and lines, r.output[-3000:]
        got = json.loads(lines[-1][len("RESULT "):])
        assert all(v["same"] for v in got.values()), got
        assert got["model=4"]["bytes_read"] == half < sum(nbytes.values()), (got, half)
        assert got["model=4,scan"]["bytes_read"] == half, got
        assert got["data=2,model=2"]["bytes_read"] == sum(nbytes.values()), got
