"""Files that prove they are whole (issue 62, round three): every file specjax reads back
is refused in one line naming it when damaged, or reads exactly what the undamaged file
reads.

- safetensors headers: a name given twice, two tensors over the same bytes, bytes no tensor
  covers, or bytes after the last one (as the ``safetensors`` package refuses them);
- GGUF headers: ``n_dims`` above GGML's 4, dimensions whose product overflows, a bad
  ``general.alignment``, metadata that is divided by or converted (``head_count`` 0, no
  ``block_count``), tensors that do not follow each other as ggml lays them out;
- feature-cache files: a SHA-256 in their JSON, checked on read; sizes checked before the
  target loads;
- Orbax steps: a checksum manifest written once a save commits, checked before a restore,
  falling back to the step before a damaged one;
- ``run.json`` and ``train eagle``'s distill shards: named when unreadable.
"""

from __future__ import annotations

import json
import struct
import tracemalloc

import numpy as np
import pytest

from specjax.models import WeightLoadError, loading
from specjax.models.gguf_file import GGUFFormatError, read_gguf


def _one_line(e: pytest.ExceptionInfo, *fragments: str) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    for f in fragments:
        assert f in msg, msg
    return msg


# ------------------------------------------------------------------------------ safetensors

def _write_st(path, header: str, data: bytes):
    """A safetensors file of the header text ``header`` (padded to 8 bytes) and ``data``."""
    b = header.encode()
    b += b" " * (-len(b) % 8)
    path.write_bytes(struct.pack("<Q", len(b)) + b + data)
    return path


def _entry(name: str, start: int, n: int = 4) -> str:
    return (f'"{name}": {{"dtype": "F32", "shape": [{n}], '
            f'"data_offsets": [{start}, {start + 4 * n}]}}')


DATA = np.arange(8, dtype=np.float32).tobytes()  # two tensors of 4 floats
ST_CASES = [  # (id, header, data, the refusal's fragment)
    ("named twice", "{" + _entry("a", 0) + ", " + _entry("a", 16) + "}", DATA,
     "'a' is named twice in the header"),
    ("same bytes", "{" + _entry("a", 0) + ", " + _entry("b", 0) + ", " + _entry("c", 16) + "}",
     DATA, "overlaps tensor"),
    ("gap", "{" + _entry("a", 0) + ", " + _entry("b", 20) + "}", DATA + bytes(4),
     "bytes 16..20 after tensor 'a' belong to no tensor (next: tensor 'b')"),
    ("before the first", "{" + _entry("a", 4) + "}", bytes(4) + DATA[:16],
     "before the first tensor belong to no tensor"),
    ("past the end", "{" + _entry("a", 0) + "}", DATA,
     "bytes 16..32 after tensor 'a' belong to no tensor"),
]


@pytest.mark.parametrize("header,data,fragment", [c[1:] for c in ST_CASES],
                         ids=[c[0] for c in ST_CASES])
def test_safetensors_headers_the_package_refuses_are_refused(tmp_path, header, data,
                                                              fragment):
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    f = _write_st(tmp_path / "model.safetensors", header, data)
    with pytest.raises(SafetensorError):  # the package refuses the same file
        load_file(str(f))
    with pytest.raises(WeightLoadError) as e:
        loading.safetensors_header(f)
    _one_line(e, str(f), "not a readable safetensors file", fragment)


def test_whole_safetensors_files_still_read(tmp_path):
    """Tensors tiling the data exactly (a zero-size one included) read as the package
    reads them."""
    from safetensors.numpy import load_file, save_file

    want = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "e": np.zeros((0, 3), np.float32),
            "b": np.ones(5, np.float32)}
    save_file(want, str(tmp_path / "m.safetensors"))
    table = loading.safetensors_header(tmp_path / "m.safetensors")
    src = loading.SafetensorsSource(table)
    ref = load_file(str(tmp_path / "m.safetensors"))
    assert set(table) == set(ref)
    for k in ref:
        np.testing.assert_array_equal(src.read(k), ref[k])


def _rewrite_header(f, edit):
    """``f`` with its header text replaced by ``edit(text)`` (offsets are relative to the
    data, so the data stays valid)."""
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    _write_st(f, edit(raw[8:8 + n].decode().rstrip()), raw[8 + n:])


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A random 2-layer transformers Llama saved as safetensors."""
    import torch
    import transformers

    path = tmp_path_factory.mktemp("tiny_hf")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False)).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("case", ["named twice", "same bytes"])
def test_a_target_whose_header_reuses_names_or_bytes_is_refused(tiny_hf, tmp_path, case):
    """The issue's cases on a whole target: layer 0's ``up_proj`` named twice (the second
    entry over layer 1's bytes), or pointed at layer 1's bytes. Both loaded before,
    with other weights."""
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_hf, d)
    f = d / "model.safetensors"
    a, b = "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"

    def edit(text):
        h = json.loads(text)
        if case == "same bytes":
            h[a] = dict(h[b])
            return json.dumps(h)
        dup = json.dumps({a: h[b]})[1:-1]  # '"a": {... layer 1's range ...}'
        return json.dumps(h)[:-1] + ", " + dup + "}"

    _rewrite_header(f, edit)
    with pytest.raises(WeightLoadError) as e:
        loading.load_hf_dir(d)
    _one_line(e, str(f), "twice" if case == "named twice" else "overlaps")


def test_a_flipped_header_byte_is_refused_or_reads_the_same(tmp_path):
    """Every byte of a small safetensors header (and its length), flipped: refused in one
    line naming the file, or the same tensors with the same bytes, or a table whose names
    or shapes differ (which the loader's name and shape check refuses, naming the tensor)."""
    from safetensors.numpy import save_file

    want = {"w.a": np.arange(6, dtype=np.float32).reshape(2, 3), "w.b": np.ones(4, np.float32)}
    clean = tmp_path / "clean.safetensors"
    save_file(want, str(clean))
    raw = clean.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    f = tmp_path / "flipped.safetensors"
    outcomes = {"refused": 0, "same": 0, "renamed": 0}
    for i in range(8 + n):
        f.write_bytes(raw[:i] + bytes([raw[i] ^ 0xFF]) + raw[i + 1:])
        try:
            table = loading.safetensors_header(f)
        except WeightLoadError as e:
            assert "\n" not in str(e) and str(f) in str(e), (i, str(e))
            outcomes["refused"] += 1
            continue
        if {k: t.shape for k, t in table.items()} != {k: v.shape for k, v in want.items()}:
            outcomes["renamed"] += 1
            continue
        src = loading.SafetensorsSource(table)
        for k, v in want.items():
            np.testing.assert_array_equal(src.read(k).astype(v.dtype), v, err_msg=str(i))
            assert src.read(k).dtype == v.dtype, i
        outcomes["same"] += 1
    assert outcomes["refused"] > n // 2, outcomes  # offsets, lengths, dtypes, JSON


# ------------------------------------------------------------------------------------- GGUF

def _gguf(path, *, skip=(), extra=None, tensors=None):
    """A tiny llama GGUF file (metadata of a 1-layer toy; ``skip`` leaves keys out,
    ``extra(writer)`` adds more)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for key, v in [("block_count", 1), ("embedding_length", 32),
                   ("feed_forward_length", 64), ("head_count", 4), ("head_count_kv", 2),
                   ("context_length", 128), ("vocab_size", 64)]:
        if key not in skip:
            getattr(w, f"add_{key}")(v)
    if extra:
        extra(w)
    for name, t in (tensors or {"output_norm.weight": np.ones(32, np.float32),
                                "token_embd.weight": np.ones((64, 32), np.float32)}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tensor_info_at(raw: bytes, name: str) -> int:
    """Where tensor ``name``'s ``n_dims`` lies in the header (after its name string)."""
    key = struct.pack("<Q", len(name)) + name.encode()
    return raw.index(key) + len(key)


def test_a_huge_n_dims_is_refused_before_reading_dims(tmp_path):
    """``n_dims`` 2^32-1 read the rest of the file as dimensions (memory ~8x the file),
    then said "header ends early"; now refused at once, naming the tensor."""
    f = _gguf(tmp_path / "m.gguf", tensors={"big.weight": np.ones((1024, 1024), np.float32)})
    raw = bytearray(f.read_bytes())
    at = _tensor_info_at(raw, "big.weight")
    raw[at:at + 4] = struct.pack("<I", 2**32 - 1)
    f.write_bytes(bytes(raw))
    tracemalloc.start()
    try:
        with pytest.raises(WeightLoadError) as e:
            loading.gguf_file_config(f)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    _one_line(e, str(f), "tensor 'big.weight' has 4294967295 dimensions; GGML allows at most 4")
    assert peak < len(raw) // 4, peak  # the 4 MB file is never read as dimensions


def test_dims_whose_product_overflows_name_the_tensor(tmp_path):
    f = _gguf(tmp_path / "m.gguf")
    raw = bytearray(f.read_bytes())
    at = _tensor_info_at(raw, "token_embd.weight")
    assert struct.unpack_from("<I", raw, at)[0] == 2
    raw[at + 4:at + 20] = struct.pack("<QQ", 2**40, 2**40)
    f.write_bytes(bytes(raw))
    with pytest.raises(GGUFFormatError) as e:
        read_gguf(f)
    _one_line(e, "tensor 'token_embd.weight' has dimensions [1099511627776, 1099511627776], "
                 "whose product overflows int64")


def _u32(key, v):
    return lambda w: w.add_uint32(key, v)


GGUF_CASES = [  # (id, skip, extra, the refusal's fragment)
    ("alignment 0", (), _u32("general.alignment", 0),
     "metadata key 'general.alignment' is 0; it must be a power of 2"),
    ("alignment 3", (), _u32("general.alignment", 3),
     "metadata key 'general.alignment' is 3; it must be a power of 2"),
    ("head_count 0", ("head_count",), _u32("llama.attention.head_count", 0),
     "metadata key 'llama.attention.head_count' must be an integer >= 1, got 0"),
    ("block_count missing", ("block_count",), None,
     "metadata key 'llama.block_count' is missing"),
    ("head_count a string", ("head_count",),
     lambda w: w.add_string("llama.attention.head_count", "four"),
     "metadata key 'llama.attention.head_count' must be an integer >= 1, got 'four'"),
    ("rms eps 0", (), lambda w: w.add_float32("llama.attention.layer_norm_rms_epsilon", 0.0),
     "metadata key 'llama.attention.layer_norm_rms_epsilon' must be a finite number > 0"),
]


@pytest.mark.parametrize("skip,extra,fragment", [c[1:] for c in GGUF_CASES],
                         ids=[c[0] for c in GGUF_CASES])
def test_gguf_metadata_that_is_divided_by_or_converted_is_named(tmp_path, skip, extra,
                                                                fragment):
    f = _gguf(tmp_path / "m.gguf", skip=skip, extra=extra)
    with pytest.raises(WeightLoadError) as e:
        loading.gguf_file_config(f)
    _one_line(e, str(f), fragment)


def test_a_whole_toy_gguf_reads(tmp_path):
    """The toy file of the cases above, undamaged, reads (its config and tensors)."""
    f = _gguf(tmp_path / "m.gguf")
    cfg = loading.gguf_file_config(f)
    assert (cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.vocab_size) == (1, 4, 8, 64)
    r = read_gguf(f)
    np.testing.assert_array_equal(r.tensors[1].data, np.ones((64, 32), np.float32))


def test_a_flipped_tensor_info_byte_is_refused_or_reads_the_same(tmp_path):
    """Every byte of the tensor table (names, n_dims, dims, types, offsets) and the
    bytes after the last tensor, flipped: refused naming the file, or a table whose names
    or shapes differ (which loading refuses, naming the tensor), or the same tensors with
    the same bytes. Types and offsets are checked as ggml lays tensors out (each where the
    one before ends, aligned), and the file ends with the last tensor's padding."""
    tensors = {"a.weight": np.arange(32, dtype=np.float32),
               "b.weight": np.arange(64 * 32, dtype=np.float32).reshape(64, 32)}
    clean = _gguf(tmp_path / "clean.gguf", tensors=tensors)
    raw = clean.read_bytes()
    first = _tensor_info_at(raw, "a.weight") - 8 - len("a.weight")
    end = _tensor_info_at(raw, "b.weight") + 4 + 16 + 4 + 8
    f = tmp_path / "flipped.gguf"
    refused = 0
    for i in list(range(first, end)):
        f.write_bytes(raw[:i] + bytes([raw[i] ^ 0x01]) + raw[i + 1:])
        try:
            r = loading._open_gguf(f)
        except WeightLoadError as e:
            assert "\n" not in str(e) and str(f) in str(e), (i, str(e))
            refused += 1
            continue
        if {t.name: t.shape for t in r.tensors} != {k: v.shape for k, v in tensors.items()}:
            continue
        for t in r.tensors:
            np.testing.assert_array_equal(np.asarray(t.data), tensors[t.name], err_msg=str(i))
    assert refused > (end - first) // 2, refused
    f.write_bytes(raw + bytes(32))  # data past the last tensor's padding
    with pytest.raises(WeightLoadError) as e:
        loading._open_gguf(f)
    _one_line(e, str(f), "32 bytes after the last tensor ('b.weight') belong to no tensor")
