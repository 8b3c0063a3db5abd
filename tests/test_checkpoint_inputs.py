"""The checkpoints people bring: nothing is read silently wrong.

Each case is one row of a table, on a toy Llama target (vocab 64, hidden 32, 2 layers)
saved by transformers as an HF directory, or a random EAGLE-3 head written by
``tests/published.py``:

- weight files: a stray ``*.safetensors`` never overrides the weights; where several files
  could be the weights, transformers' order decides (checked against transformers), and
  what stays ambiguous is refused;
- RoPE: ``rope_parameters``, ``rope_scaling`` and ``rope_theta`` read as transformers 5
  reads them: where transformers accepts a config, the rotary cos/sin at position 54 equal
  transformers'; where it refuses one, specjax refuses it too (and refuses the types it
  does not compute);
- dtypes: integer, boolean and complex weights are refused (EAGLE-3's index tensors
  ``d2t`` and ``t2d`` are not weights);
- config values missing or of the wrong type: one line naming the file and the key.
"""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
import torch

from published import edit_state_dict, write_eagle3_head
import toys
from specjax import cli
from specjax.heads import CheckpointError, published
from specjax.models import WeightLoadError, load_gguf, load_hf_dir, loading
from specjax.models.llama import rope_inv_freq

V, H = 64, 32
LLAMA = dict(model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=64,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, tie_word_embeddings=False)
GEMMA3 = dict(model_type="gemma3_text", vocab_size=V, hidden_size=H, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
              max_position_embeddings=128, sliding_window=16,
              layer_types=["sliding_attention", "full_attention"])
GEMMA2 = dict(GEMMA3, model_type="gemma2")
T5 = dict(model_type="t5", vocab_size=V, d_model=H, d_ff=64, num_layers=2, num_heads=4,
          d_kv=8, decoder_start_token_id=0)
BASES = {"llama": LLAMA, "gemma3": GEMMA3, "gemma2": GEMMA2, "t5": T5}
#: the target a head is checked against (6 layers, as EAGLE-3 fuses three of them)
TARGET = toys.LLAMA_6
HEAD = dict(hidden=H, heads=4, kv_heads=2, intermediate=64, vocab=V, draft_vocab=24)


_one_line = toys.one_line


def _write_config(path, d, text: str | None = None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(d) if text is None else text)
    return path


# ----------------------------------------------------------------------------- weight files

@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """(directory, tensors, params): a random transformers Llama saved as safetensors, and
    the parameters specjax loads from it."""
    import transformers
    from safetensors.numpy import load_file

    path = tmp_path_factory.mktemp("clean")
    cfg = {k: v for k, v in LLAMA.items() if k != "model_type"}
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).save_pretrained(str(path))
    params = jax.tree.map(np.asarray, load_hf_dir(path)[1])
    return path, load_file(str(path / "model.safetensors")), params


def _save(path, tensors: dict, name: str, scale: float = 1.0):
    from safetensors.numpy import save_file

    save_file({k: v * scale if scale != 1 else v for k, v in tensors.items()},
              str(path / name))


def _shard(path, tensors: dict, scale: float = 1.0, extra: str | None = None):
    """``tensors`` split over two shards and an index; ``extra``: a tensor the index puts
    in the first shard that the second holds too, with other values."""
    names = sorted(tensors)
    half = {"model-1.safetensors": names[::2], "model-2.safetensors": names[1::2]}
    if extra:
        half = {f: [n for n in ns if n != extra] for f, ns in half.items()}
        half["model-1.safetensors"].append(extra)
    for fname, ns in half.items():
        held = {n: tensors[n] for n in ns}
        if extra and fname == "model-2.safetensors":
            held[extra] = tensors[extra] * 2.0
        _save(path, held, fname, scale)
    index = {"metadata": {}, "weight_map": {n: f for f, ns in half.items() for n in ns}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def _layout(clean, tmp_path, case: str):
    """The clean directory rearranged as ``case`` names."""
    src, tensors, _ = clean
    d = tmp_path / case
    shutil.copytree(src, d)
    if case == "stray":
        _save(d, tensors, "model_backup.safetensors", scale=3.0)
    elif case == "index+stray":
        (d / "model.safetensors").unlink()
        _shard(d, tensors)
        _save(d, tensors, "model_backup.safetensors", scale=3.0)
    elif case == "model+index":  # transformers reads model.safetensors first
        _shard(d, tensors, scale=3.0)
    elif case in ("named", "named-missing", "named-outside"):  # config's transformers_weights
        name = {"named": "chosen.safetensors", "named-missing": "gone.safetensors",
                "named-outside": "../chosen.safetensors"}[case]
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(dict(cfg, transformers_weights=name)))
        (d / "model.safetensors").rename(d / "chosen.safetensors")
        _save(d, tensors, "model.safetensors", scale=3.0)
    elif case == "several":
        (d / "model.safetensors").rename(d / "weights.safetensors")
        _save(d, tensors, "model_backup.safetensors", scale=3.0)
    elif case == "in-two-shards":
        (d / "model.safetensors").unlink()
        _shard(d, tensors, extra="model.norm.weight")
    return d


@pytest.mark.parametrize("case", ["stray", "index+stray", "model+index", "named"])
def test_weight_files_read_are_transformers_and_a_stray_file_changes_nothing(clean, tmp_path,
                                                                              case):
    import transformers

    d = _layout(clean, tmp_path, case)
    params = load_hf_dir(d)[1]
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(clean[2]), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(d))
    np.testing.assert_array_equal(hf.model.norm.weight.detach().numpy(),
                                  clean[1]["model.norm.weight"])


@pytest.mark.parametrize("case,fragment", [
    ("several", "several weight files ['model_backup.safetensors', 'weights.safetensors']"),
    ("in-two-shards", ("holds 'model.norm.weight', which model.safetensors.index.json "
                       "does not assign to it")),
    ("named-missing", "'transformers_weights' names gone.safetensors, which does not exist"),
    ("named-outside", "'transformers_weights' must name a .safetensors"),
])
def test_ambiguous_weight_files_are_refused(clean, tmp_path, case, fragment):
    d = _layout(clean, tmp_path, case)
    with pytest.raises(WeightLoadError) as e:
        load_hf_dir(d)
    _one_line(e, fragment)


# ----------------------------------------------------------------------------- RoPE

L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}
V5 = {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
NESTED = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


#: (id, family, config edit, None where transformers accepts it (the cos/sin must then
#: match), else (a fragment of specjax's refusal, whether transformers refuses it too))
ROPE = [
    ("v5+v4 linear: rope_scaling wins, base 10000", "llama",
     dict(V5, rope_scaling={"rope_type": "linear", "factor": 4.0}), None),
    ("v5+v4 llama3", "llama", dict(V5, rope_scaling=L3), None),
    ("v5+v4, the base inside rope_scaling", "llama",
     dict(V5, rope_scaling={"type": "linear", "factor": 2.0, "rope_theta": 30000.0}), None),
    ("v5+v4, top-level rope_theta", "llama",
     dict(V5, rope_theta=20000.0, rope_scaling={"type": "linear", "factor": 2.0}), None),
    ("v5 with rope_scaling null", "llama",
     {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
      "rope_scaling": None}, None),
    ("v4 llama3 without original_max_position_embeddings", "llama",
     {"rope_theta": 5e5, "rope_scaling": _without(L3, "original_max_position_embeddings")},
     None),
    ("v5 llama3 without rope_theta", "llama", {"rope_parameters": L3}, None),
    ("v5+v4 yarn", "llama", dict(V5, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     ("'rope_scaling.rope_type' 'yarn' is not supported", False)),
    ("v5 unknown type", "llama", {"rope_parameters": {"rope_type": "foo", "rope_theta": 1e4}},
     ("'rope_parameters.rope_type' 'foo' is not supported", True)),
    ("v4 unknown type", "llama", {"rope_scaling": {"type": "foo", "factor": 2.0}},
     ("'rope_scaling.type' 'foo' is not supported", True)),
    ("llama3 without factor", "llama", {"rope_scaling": _without(L3, "factor")},
     ("'rope_scaling.factor' is missing", True)),
    ("llama3 without low_freq_factor", "llama", {"rope_scaling": _without(L3, "low_freq_factor")},
     ("'rope_scaling.low_freq_factor' is missing", True)),
    ("llama3 without high_freq_factor", "llama",
     {"rope_scaling": _without(L3, "high_freq_factor")},
     ("'rope_scaling.high_freq_factor' is missing", True)),
    ("linear without factor", "llama", {"rope_scaling": {"type": "linear"}},
     ("'rope_scaling.factor' is missing", True)),
    ("rope_scaling a string", "llama", {"rope_scaling": "linear"},
     ("'rope_scaling' must be an object, got 'linear'", True)),
    ("factor a string", "llama", {"rope_scaling": {"type": "linear", "factor": "2"}},
     ("'rope_scaling.factor' must be a positive number, got '2'", True)),
    ("gemma3 v4 linear (Gemma 3 4B's)", "gemma3",
     {"rope_theta": 1e6, "rope_local_base_freq": 1e4,
      "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, None),
    ("gemma3 v5 nested, rope_scaling updating full_attention", "gemma3",
     {"rope_parameters": NESTED, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, None),
    ("gemma3 flat rope_parameters", "gemma3",
     {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}},
     ("which transformers does not read for gemma3_text", False)),
    ("gemma3 scaled sliding layers", "gemma3",
     {"rope_parameters": {**NESTED, "sliding_attention": {"rope_type": "linear",
                                                          "factor": 2.0}}},
     ("'rope_parameters.sliding_attention' scaling 'linear' is not supported", False)),
    ("gemma2 v4 rope_theta", "gemma2", {"rope_theta": 20000.0}, None),
    ("gemma2 nested", "gemma2", {"rope_parameters": NESTED},
     ("'rope_parameters' is nested by layer type", True)),
]


def _hf_cos_sin(path, family: str) -> dict[str, np.ndarray] | Exception:
    """transformers' rotary (cos, sin) at position 54 per layer type, or what it raised
    reading the config or building the model."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
        rotary = transformers.AutoModelForCausalLM.from_config(config).model.rotary_emb
    except Exception as e:  # noqa: BLE001 -- any refusal counts
        return e
    x, pos = torch.zeros(1), torch.tensor([[54]])
    if family == "gemma3":
        return {t: np.stack([c.numpy() for c in rotary(x, pos, t)])
                for t in ("full_attention", "sliding_attention")}
    cos_sin = np.stack([c.numpy() for c in rotary(x, pos)])
    return {"full_attention": cos_sin, "sliding_attention": cos_sin}


def _cos_sin(cfg) -> dict[str, np.ndarray]:
    """specjax's rotary (cos, sin) at position 54 per layer type, in transformers' layout."""
    def at54(inv):
        angles = 54.0 * np.asarray(inv, np.float32)
        emb = np.concatenate([angles, angles])[None, None]
        return np.stack([np.cos(emb), np.sin(emb)])
    full = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    local = (rope_inv_freq(cfg.head_dim, cfg.rope_local_theta)
             if hasattr(cfg, "rope_local_theta") else full)
    return {"full_attention": at54(full), "sliding_attention": at54(local)}


@pytest.mark.parametrize("family,edit,refusal", [r[1:] for r in ROPE], ids=[r[0] for r in ROPE])
def test_rope_reads_as_transformers_reads_it(tmp_path, family, edit, refusal):
    d = _write_config(tmp_path / "cfg", dict(BASES[family], **edit))
    hf = _hf_cos_sin(d, family)
    if refusal is None:
        assert not isinstance(hf, Exception), f"transformers refused it: {hf!r}"
        ours = _cos_sin(loading.hf_dir_config(d))
        for t in hf:
            np.testing.assert_allclose(ours[t], hf[t], rtol=0, atol=2e-5, err_msg=t)
        return
    fragment, hf_refuses = refusal
    assert isinstance(hf, Exception) == hf_refuses, hf
    with pytest.raises(WeightLoadError) as e:
        loading.hf_dir_config(d)
    _one_line(e, str(d / "config.json"), fragment)


def test_the_first_rows_would_catch_a_reader_that_ignores_rope_scaling(tmp_path):
    """The v5+v4 rows differ from default RoPE at base 5e5, which the old reader used."""
    d = _write_config(tmp_path / "cfg", dict(LLAMA, **ROPE[0][2]))
    plain = _cos_sin(loading.hf_dir_config(_write_config(tmp_path / "v5", dict(LLAMA, **V5))))
    assert np.abs(_cos_sin(loading.hf_dir_config(d))["full_attention"]
                  - plain["full_attention"]).max() > 0.1


def test_a_heads_rope_is_read_by_the_same_reader(tmp_path):
    """A published head's config.json: rope_scaling wins as for a target, and a bad one is
    refused naming the head's config.json."""
    _, cfg = write_eagle3_head(tmp_path, **HEAD)
    cfg = dict(cfg, **ROPE[1][2])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = published.load(tmp_path, TARGET).spec
    want = loading.hf_config(cfg)
    assert (spec.rope_theta, spec.rope_scaling) == (want.rope_theta, want.rope_scaling)
    assert spec.rope_scaling.rope_type == "llama3" and spec.rope_theta == 10000.0
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, rope_scaling="linear")))
    with pytest.raises(CheckpointError) as e:
        published.load(tmp_path, TARGET)
    _one_line(e, str(tmp_path / "config.json"), "'rope_scaling' must be an object")


# ----------------------------------------------------------------------------- dtypes

@pytest.mark.parametrize("dtype", [np.int8, np.bool_, np.complex64, np.int32])
def test_target_weights_that_are_not_floats_are_refused(clean, tmp_path, dtype):
    d = tmp_path / "t"
    shutil.copytree(clean[0], d)
    tensors = dict(clean[1])
    tensors["model.norm.weight"] = (tensors["model.norm.weight"] * 100).astype(dtype)
    _save(d, tensors, "model.safetensors")
    with pytest.raises(WeightLoadError) as e:
        load_hf_dir(d)
    _one_line(e, "model.safetensors: tensor 'model.norm.weight' is stored as "
                 f"{np.dtype(dtype).name}; weights must be floating point")


def test_a_gguf_integer_tensor_is_refused(tmp_path):
    import gguf

    path = tmp_path / "int.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in [(w.add_block_count, 1), (w.add_embedding_length, H),
                   (w.add_feed_forward_length, 64), (w.add_head_count, 4),
                   (w.add_head_count_kv, 2), (w.add_context_length, 128), (w.add_vocab_size, V)]:
        add(v)
    w.add_tensor("output_norm.weight", np.full((H,), 106, np.int8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(WeightLoadError) as e:
        load_gguf(path)
    _one_line(e, "tensor 'output_norm.weight' is stored as int8")


HEAD_DTYPES = [  # (id, change to the state dict, None or the refusal's fragment)
    ("d2t int64, t2d bool", lambda sd: None, None),
    ("int8 weights", lambda sd: sd.update({k: (v * 100).to(torch.int8) for k, v in sd.items()
                                            if v.is_floating_point()}),
     "tensor 'fc.weight' is stored as int8; weights must be floating point"),
    ("a bool norm", lambda sd: sd.update({"norm.weight": sd["norm.weight"] > 1}),
     "tensor 'norm.weight' is stored as bool"),
    ("a complex weight", lambda sd: sd.update({"lm_head.weight": sd["lm_head.weight"].to(
        torch.complex64)}), "tensor 'lm_head.weight' is stored as complex64"),
    ("d2t as floats", lambda sd: sd.update({"d2t": sd["d2t"].float()}),
     "tensor 'd2t' is stored as float32; it must hold integers"),
]


@pytest.mark.parametrize("change,refusal", [h[1:] for h in HEAD_DTYPES],
                         ids=[h[0] for h in HEAD_DTYPES])
def test_head_weights_that_are_not_floats_are_refused(tmp_path, change, refusal):
    write_eagle3_head(tmp_path, **HEAD)
    edit_state_dict(tmp_path, change)
    if refusal is None:
        head = published.load(tmp_path, TARGET)
        assert head.vocab_ids.dtype == np.int32 and head.params["norm"].dtype == np.float32
        return
    with pytest.raises(CheckpointError) as e:
        published.load(tmp_path, TARGET)
    _one_line(e, "pytorch_model.bin: " + refusal)


# ----------------------------------------------------------------------------- config values

#: (family, config edit (a key set to None is removed), fragment of the one-line refusal)
TARGET_CONFIGS = [
    ("llama", {"vocab_size": None}, "'vocab_size' is missing"),
    ("llama", {"model_type": None}, "'model_type' is missing: it names the architecture"),
    ("llama", {"num_attention_heads": None}, "'num_attention_heads' is missing"),
    ("llama", {"intermediate_size": None}, "'intermediate_size' is missing"),
    ("llama", {"hidden_size": "32"}, "'hidden_size' must be an integer >= 1, got '32'"),
    ("llama", {"num_hidden_layers": 2.0}, "'num_hidden_layers' must be an integer"),
    ("llama", {"max_position_embeddings": 0}, "'max_position_embeddings' must be an integer"),
    ("llama", {"tie_word_embeddings": "false"}, "'tie_word_embeddings' must be true or false"),
    ("llama", {"rms_norm_eps": "1e-5"}, "'rms_norm_eps' must be a positive number"),
    ("llama", {"rope_theta": "1e4"}, "'rope_theta' must be a positive number"),
    ("llama", {"model_type": "qwen2", "use_sliding_window": "no"},
     "'use_sliding_window' must be true or false"),
    ("gemma3", {"vocab_size": None}, "'vocab_size' is missing"),
    ("gemma3", {"head_dim": "16"}, "'head_dim' must be an integer"),
    ("gemma3", {"layer_types": "sliding_attention"}, "'layer_types' must be a list of strings"),
    ("t5", {"d_model": "32"}, "'d_model' must be an integer"),
    ("t5", {"num_heads": None}, "'num_heads' is missing"),
]


@pytest.mark.parametrize("family,edit,fragment", TARGET_CONFIGS,
                         ids=[f"{c[0]}-{next(iter(c[1]))}-{c[2][:12]}" for c in TARGET_CONFIGS])
def test_target_config_values_are_checked(tmp_path, family, edit, fragment):
    cfg = {k: v for k, v in dict(BASES[family], **edit).items() if v is not None}
    d = _write_config(tmp_path / "t", cfg)
    with pytest.raises(WeightLoadError) as e:
        load_hf_dir(d)
    _one_line(e, f"{d / 'config.json'}: {fragment}")


@pytest.mark.parametrize("text,fragment", [("{not json", "not a readable JSON file"),
                                           ("[1, 2]", "holds a JSON list, not an object")])
def test_a_corrupt_target_config_is_named(tmp_path, text, fragment):
    d = _write_config(tmp_path / "t", None, text)
    with pytest.raises(WeightLoadError) as e:
        load_hf_dir(d)
    _one_line(e, f"{d / 'config.json'}: {fragment}")


HEAD_CONFIGS = [  # (config edit, a key set to None is removed; fragment)
    ({"hidden_size": None}, "'hidden_size' is missing"),
    ({"hidden_size": "32"}, "'hidden_size' must be an integer >= 1, got '32'"),
    ({"num_attention_heads": None}, "'num_attention_heads' is missing"),
    ({"intermediate_size": 64.5}, "'intermediate_size' must be an integer"),
    ({"draft_vocab_size": "24"}, "'draft_vocab_size' must be an integer"),
    ({"rms_norm_eps": [1e-5]}, "'rms_norm_eps' must be a positive number"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": ["1", 2, 3]}},
     "'eagle_config.eagle_aux_hidden_state_layer_ids' must be a list of integers"),
]


@pytest.mark.parametrize("edit,fragment", HEAD_CONFIGS, ids=[h[1][:30] for h in HEAD_CONFIGS])
def test_head_config_values_are_checked(tmp_path, edit, fragment):
    _, cfg = write_eagle3_head(tmp_path, **HEAD)
    cfg = {k: v for k, v in dict(cfg, **edit).items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        published.load(tmp_path, TARGET)
    _one_line(e, f"{tmp_path / 'config.json'}: {fragment}")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError) as e:
        published.load(tmp_path, TARGET)
    _one_line(e, f"{tmp_path / 'config.json'}: not a readable JSON file")


def test_the_cli_prints_a_bad_config_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPECJAX_DEBUG", raising=False)
    d = _write_config(tmp_path / "t", dict(LLAMA, hidden_size="32"))
    assert cli.main(["generate", "--model", str(d), "--prompt", "hi"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"specjax: error: {d / 'config.json'}: 'hidden_size' must be an integer "
                   ">= 1, got '32'"), err
