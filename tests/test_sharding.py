"""Sharded decoding on 8 simulated CPU devices equals the one-device run, token for token,
and sharded training (EAGLE and on-policy) reaches the one-device parameters to 1e-5.

JAX fixes its device count when it starts, so in the ordinary (one-device) test process two
tests re-run this file in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and require every selected test there
to pass (none skipped): the random-weight tests by default, the real-weight ones (marked
``slow``) only on request (``pytest -m slow tests/test_sharding.py``). The error tests run
in both processes.
"""

from __future__ import annotations

import dataclasses

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import toys
import specjax
from specjax import methods, sharding
from specjax.drafters import eagle
from specjax.models import Llama
from specjax.models.llama import init_params

N_DEVICES = 8
NEW = 16
TOY = toys.LLAMA_WIDE
V = TOY.vocab_size
PROMPTS = [[1, 5, 2, 7, 5, 9], [3, 3, 1, 4], [7, 2, 7, 2, 7, 9, 11, 2], [5, 6],
           [9, 8, 7, 6, 5, 4, 3], [2, 2, 2], [11, 13, 17, 19, 23], [4, 1, 4, 1, 4]]
MESHES = {"data=8": (8, 1), "model=8": (1, 8), "data=2,model=4": (2, 4)}


@pytest.fixture(scope="module")
def toy():
    model = Llama(TOY)
    return model, jax.tree.map(lambda x: x * 3.0, init_params(TOY, jax.random.key(1)))


# --------------------------------------------------------------------- errors (any process)

def test_bad_meshes_are_refused_clearly(toy):
    model, tp = toy
    with pytest.raises(ValueError, match="unknown mesh axis 'rows'"):
        sharding.parse_mesh("rows=2")
    with pytest.raises(ValueError, match="size must be an int >= 1"):
        sharding.parse_mesh("data=0")
    with pytest.raises(ValueError, match="expected data=N"):
        sharding.parse_mesh("data=two")
    n = jax.device_count()
    with pytest.raises(ValueError, match=f"needs {2 * n} devices, but {n} are visible"):
        sharding.make_mesh(data=2 * n)
    one = sharding.make_mesh(1, 1)
    with pytest.raises(ValueError, match="does not divide"):  # 3 heads over model=1 is fine
        sharding.check_model(dataclasses.replace(TOY, hidden_size=24, intermediate_size=48,
                                                             num_layers=1, num_heads=3,
                                                             num_kv_heads=3),
                             _fake_mesh(model=2))
    sharding.check_model(TOY, one)
    with pytest.raises(ValueError, match="does not divide the batch of 3 rows"):
        sharding.check_batch(3, _fake_mesh(data=2))


def _fake_mesh(data=1, model=1):
    """A mesh shape without devices (for the checks that only read sizes)."""
    class M:
        shape = {"data": data, "model": model}
    return M()


# ----------------------------------------------------------- on 8 simulated devices only

if jax.device_count() < N_DEVICES:
    def _run_on_8_devices(marker: str) -> None:
        """Runs this file's tests selected by ``-m marker`` on 8 simulated CPU devices in a
        subprocess; all must pass, none skipped."""
        # at XLA's own code generation (not the suite's -O1, tests/conftest.py): the
        # training equalities sit within float32 rounding of 1e-5
        flags = re.sub(r"--xla_backend_optimization_level=\S+", "",
                       os.environ.get("XLA_FLAGS", ""))
        env = {**os.environ, "SPECJAX_TESTS_XLA_DEFAULTS": "1", "XLA_FLAGS":
               f"{flags} --xla_force_host_platform_device_count={N_DEVICES}".strip()}
        if marker == "not slow":  # toys only (tests/toys.py: TOY_XLA_FLAG)
            env = toys.toy_process_env(env)
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "-m", marker, __file__], env=env, capture_output=True,
                           text=True, timeout=1500, cwd=os.path.dirname(os.path.dirname(__file__)))
        tail = r.stdout[-6000:] + r.stderr[-3000:]
        assert r.returncode == 0, tail
        assert " passed" in r.stdout and "skipped" not in r.stdout, tail
        print(r.stdout[-600:])

    def test_sharded_toys_on_8_simulated_cpu_devices():
        """The random-weight tests below on 8 simulated devices (sharded output equal to one
        device's: ar, EAGLE-2, ReDrafter and HSD on a 2-layer Llama toy on data=2,model=4,
        ar and the n-gram drafter on Gemma and T5 toys; the parameter and cache shardings;
        20 EAGLE-head steps on data=2,model=4 (killed and resumed) and two on-policy rounds
        on data=2,model=4 equal to one device's with the optimizer state sharded). Runs by
        default; the 1-D meshes (decoding on data=8 and model=8, EAGLE training on data=8)
        and T5 v1.1 run with the real weights, opt-in."""
        _run_on_8_devices("not slow")

    @pytest.mark.slow
    @pytest.mark.extended
    def test_sharded_real_weights_on_8_simulated_cpu_devices():
        """The tests below marked slow (SmolLM2-135M on data=2,model=3, the sharding
        notebook, the 1-D meshes and T5 v1.1) on 8 simulated devices: about a minute of loading and compiling on 2 CPU
        cores, so opt-in (``pytest -m slow`` or ``-m extended``, see tests/conftest.py)."""
        _run_on_8_devices("slow")
else:
    @pytest.fixture(scope="module")
    def unsharded(toy):
        """Greedy AR on one device: every lossless method's tokens (tests/test_speculative.py
        and tests/test_hsd.py check that each method equals AR unsharded)."""
        model, tp = toy
        return specjax.generate(model, tp, PROMPTS, max_new_tokens=NEW).to_lists()

    # every registered method (its first tiny spec) on one mesh by default, ar and EAGLE-2 on
    # the 1-D meshes opt-in; the n-gram drafter sharded: the Gemma and T5 toys below
    SHARDED = toys.sweep_specs(skip={
        "sd": "sharded on the Gemma and T5 toys below",
        "eagle3": "fuses the features of three layers: this 2-layer toy has too few"})

    @pytest.mark.parametrize("mesh, specs", [
        ("data=2,model=4", SHARDED),
        pytest.param("data=8", ("ar", "eagle2:3,2,5"), marks=pytest.mark.slow),
        pytest.param("model=8", ("ar", "eagle2:3,2,5"), marks=pytest.mark.slow)],
        ids=lambda x: x if isinstance(x, str) else None)
    def test_sharded_methods_equal_one_device(toy, unsharded, mesh, specs):
        model, tp = toy
        m = sharding.make_mesh(*MESHES[mesh])
        for spec in specs:
            out = toys.run_spec(spec, model, tp, PROMPTS, NEW, mesh=m)
            assert out.to_lists() == unsharded, (mesh, spec)


    def test_parameter_and_cache_shardings_follow_the_spec(toy):
        model, tp = toy
        m = sharding.make_mesh(2, 4)
        sp = sharding.shard_params(TOY, tp, m)
        lp = sp["layers"][0]
        assert "qkv" not in lp and "gate_up" not in lp
        assert lp["q"].sharding.spec == P("model", None)   # 8 query heads over 4
        assert lp["k"].sharding.spec == P("model", None)   # 4 KV heads over 4
        assert lp["o"].sharding.spec == P(None, "model")
        assert lp["gate"].sharding.spec == P("model", None)
        assert lp["down"].sharding.spec == P(None, "model")
        assert lp["attn_norm"].sharding.spec == P()
        assert sp["embed"].sharding.spec == P("model", None)  # 64 vocabulary rows over 4
        q_devices = {s.data.shape for s in lp["q"].addressable_shards}
        assert q_devices == {(TOY.num_heads * TOY.head_dim // 4, TOY.hidden_size)}
        wide = sharding.shard_params(TOY, tp, sharding.make_mesh(1, 8))
        assert wide["layers"][0]["k"].sharding.spec == P()  # 4 KV heads do not split 8 ways
        assert wide["layers"][0]["q"].sharding.spec == P("model", None)
        np.testing.assert_array_equal(  # the split layout holds the same numbers
            np.concatenate([np.asarray(lp[n]) for n in ("q", "k", "v")]),
            np.asarray(tp["layers"][0]["qkv"]))
        cache = jax.jit(lambda: sharding.constrain_cache(model.init_cache(8, 64), m))()
        assert _spec(cache.k[0]) == _spec(cache.v[0]) == ("data", "model")
        assert _spec(cache.length) == ("data",)
        x = specjax.prepare(model, PROMPTS, 8, mesh=m)
        assert _spec(x.tokens) == ("data",)

    def _spec(x) -> tuple:
        """``x``'s partition spec without trailing unsplit axes."""
        s = tuple(x.sharding.spec)
        while s and s[-1] is None:
            s = s[:-1]
        return s

    def test_real_weights_sharded_equal_one_device(smollm):
        """SmolLM2-135M (9 query and 3 KV heads) on data=2,model=3: AR and EAGLE-2."""
        lm = smollm
        ids = [lm.encode("Name three primary colors.", chat=True),
               lm.encode("What is 12 times 7?", chat=True)]
        m = sharding.make_mesh(2, 3)
        d, dp = methods.load_drafter("eagle2", lm, "smollm2-135m")
        runs = {"ar": lambda mesh: specjax.generate(lm.model, lm.params, ids, max_new_tokens=16,
                                                    mesh=mesh),
                "eagle2": lambda mesh: specjax.speculative_generate(
                    lm.model, lm.params, d, dp, ids, max_new_tokens=16, mesh=mesh)}
        ref = {name: run(None).to_lists() for name, run in runs.items()}
        assert ref["ar"] == ref["eagle2"]
        for name, run in runs.items():
            assert run(m).to_lists() == ref[name], name

    def test_gemma_sharded_equals_one_device():
        """A toy Gemma 3 (sliding and global layers, QK-norm) on data=2,model=4."""
        from specjax.models import gemma

        cfg = gemma.GemmaConfig(vocab_size=V, hidden_size=64, intermediate_size=128,
                                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                layer_types=(gemma.SLIDING, gemma.FULL), sliding_window=6,
                                query_pre_attn_scalar=16, max_position_embeddings=512)
        g = gemma.Gemma(cfg)
        gp = jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x,
                          gemma.init_params(cfg, jax.random.key(4)))
        ng = specjax.NGramDrafter(depth=4, min_ngram=1)
        m = sharding.make_mesh(2, 4)
        sp = sharding.shard_params(cfg, gp, m)
        assert sp["layers"][0]["q"].sharding.spec == P("model", None)  # 4 query heads over 4
        assert sp["layers"][0]["k"].sharding.spec == P()  # 2 KV heads do not split 4 ways
        ref = specjax.generate(g, gp, PROMPTS, max_new_tokens=NEW).to_lists()
        assert specjax.generate(g, gp, PROMPTS, max_new_tokens=NEW, mesh=m).to_lists() == ref
        assert specjax.speculative_generate(g, gp, ng, None, PROMPTS, max_new_tokens=NEW,
                                            mesh=m).to_lists() == ref

    def test_gemma4_sharded_equals_one_device():
        """The Gemma 4 toy (layers of two geometries, KV sharing, per-layer embeddings) on
        data=2,model=4: query heads and MLP columns split, the one-head full layers' K/V
        and cache whole; ar and its own methods (``mtp``: the assistant replicated) equal
        one device."""
        model, tp = toys.gemma4_toy()
        m = sharding.make_mesh(2, 4)
        sp = sharding.shard_params(model.config, tp, m)
        assert sp["layers"][0]["q"].sharding.spec == P("model", None)
        assert sp["layers"][1]["k"].sharding.spec == P()  # one K/V head on the full layers
        assert sp["layers"][3]["gate"].sharding.spec == P("model", None)  # double-wide
        cache = jax.jit(lambda: sharding.constrain_cache(model.init_cache(4, 64), m))()
        assert [_spec(x) for x in cache.k] == [("data",)] * len(cache.k)
        specs = toys.sweep_specs(family="Gemma4", own=True)
        assert "mtp:3" in specs
        ref = specjax.generate(model, tp, toys.PROMPTS, max_new_tokens=toys.BUDGETS).to_lists()
        for spec in specs:  # each equals one-device ar (tests/test_conformance.py: unsharded)
            out = toys.run_spec(spec, model, tp, toys.PROMPTS, toys.BUDGETS, mesh=m)
            assert out.to_lists() == ref, spec

    def test_gemma4_loads_straight_onto_a_mesh(tmp_path):
        """A Gemma 4 HF directory (transformers' classes, saved) streamed onto data=2,
        model=4: each weight on its sharding, the values those of a one-device load."""
        import torch
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig

        torch.manual_seed(0)
        Gemma4ForCausalLM(Gemma4TextConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
            layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4,
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=64,
            num_kv_shared_layers=2)).save_pretrained(str(tmp_path))
        m = sharding.make_mesh(2, 4)
        one = specjax.models.load(str(tmp_path), tokenizer=False)
        on = specjax.models.load(str(tmp_path), tokenizer=False, mesh=m)
        assert on.params["layers"][0]["q"].sharding.spec == P("model", None)
        assert on.params["ple_embed"].sharding.spec == P("model", None)  # 64 rows over 4
        for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(on.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    @pytest.mark.parametrize("gated", [False, pytest.param(True, marks=pytest.mark.slow)],
                             ids=["t5", "t5-v1_1"])
    def test_t5_sharded_equals_one_device(gated):
        """A toy T5 (original and v1.1 layouts): encoder, self- and cross-attention heads and
        MLP columns over model=4, rows and the bound source over data=2; ar and the n-gram
        drafter over the source (HSD sharded: the Llama toy above; on T5: tests/test_t5.py)."""
        from specjax.core import encdec
        from specjax.models import t5

        cfg = t5.T5Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=2,
                          num_encoder_layers=2, num_heads=4, head_dim=8, num_buckets=8,
                          max_distance=20, gated=gated,
                          activation="gelu_new" if gated else "relu")
        model = t5.T5(cfg)
        tp = jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x,
                          t5.init_params(cfg, jax.random.key(5)))
        m = sharding.make_mesh(2, 4)
        sp = sharding.shard_params(cfg, encdec.encode(model, tp, PROMPTS), m)
        enc, dec, src = sp["encoder"]["layers"][0], sp["layers"][0], sp["source"]
        assert enc["q"].sharding.spec == P("model", None)
        assert enc["o"].sharding.spec == dec["wo"].sharding.spec == P(None, "model")
        assert dec["cross_k"].sharding.spec == P("model", None)
        assert dec["cross_o"].sharding.spec == P(None, "model")
        assert ("gate" in dec and "wi" not in dec) if gated else "wi" in dec
        assert dec["gate" if gated else "wi"].sharding.spec == P("model", None)
        assert sp["rel_bias"].sharding.spec == P()
        assert _spec(src.k[0]) == ("data", "model") and _spec(src.tokens) == ("data",)
        ng = specjax.NGramDrafter(depth=4, min_ngram=1)
        ref = specjax.generate(model, tp, PROMPTS, max_new_tokens=NEW).to_lists()
        assert specjax.generate(model, tp, PROMPTS, max_new_tokens=NEW, mesh=m).to_lists() == ref
        assert specjax.speculative_generate(model, tp, ng, None, PROMPTS, max_new_tokens=NEW,
                                            mesh=m).to_lists() == ref

    STEPS = 20  # EAGLE-head optimizer steps in the training runs below

    def _close(ref, got):
        """Parameters equal to 1e-5, absolute, with no relative slack (rtol 0): the EAGLE
        runs differ by at most 4e-7 (float rounding of the sharded reductions)."""
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                             rtol=0, atol=1e-5), ref, got)

    def _moved(params, init) -> float:
        return max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                                                params, init)))

    def _moments_sharded(state, mesh) -> None:
        """Adam's first moment of the head's largest matrix lives split over the mesh
        (ZeRO-1: ``loop.zero_spec``), each device holding 1/(data x model) of it."""
        from specjax.train import loop

        mu = next(s.mu for s in jax.tree.leaves(state["opt_state"], is_leaf=lambda x:
                                                hasattr(x, "mu")) if hasattr(s, "mu"))
        big = max(jax.tree.leaves(mu), key=lambda x: x.size)
        n = int(mesh.devices.size)
        assert big.sharding.spec == loop.zero_spec(big.shape, mesh) != P(), big.sharding.spec
        assert {sh.data.size for sh in big.addressable_shards} == {big.size // n}
        assert all(x.sharding.spec == P() for x in jax.tree.leaves(state["params"]))

    @pytest.fixture(scope="module")
    def eagle_run(toy, tmp_path_factory):
        """A toy distilled corpus and 20 EAGLE-head steps on one device (no input noise:
        the noise's shape would change with the padding rows)."""
        from specjax.train import distill
        from specjax.train import eagle as train_eagle

        model, tp = toy
        lm = toys.ToyLM(model, tp)
        rng = np.random.default_rng(0)
        prompts = [list(rng.integers(1, V, size=n)) for n in rng.integers(3, 12, size=12)]
        corpus = distill.answer_batch(lm, prompts, max_new_tokens=12)
        cfg = train_eagle.TrainConfig(steps=STEPS, batch_tokens=384, max_len=64, lr=1e-2,
                                      warmup=1, save_every=10, seed=1, noise=0.0)
        one = train_eagle.train(model, tp, corpus, cfg, tmp_path_factory.mktemp("one"))
        return corpus, cfg, one

    @pytest.mark.parametrize("mesh", [pytest.param("data=8", marks=pytest.mark.slow),
                                      "data=2,model=4"])  # the 1-D mesh opt-in, as above
    def test_eagle_training_on_a_mesh_equals_one_device(toy, eagle_run, tmp_path, mesh):
        """20 EAGLE-head steps with the target sharded, rows over ``data`` (batches of 6 and
        5 rows padded with zero rows whose loss mask is zero) and the optimizer state
        sharded reach the one-device parameters to 1e-5; on data=2,model=4 the run is
        killed after 10 steps and resumed from its (sharded) checkpoint."""
        from specjax.train import eagle as train_eagle

        model, tp = toy
        corpus, cfg, one = eagle_run
        m = sharding.make_mesh(*MESHES[mesh])
        run = lambda **kw: train_eagle.train(model, tp, corpus, cfg, tmp_path, mesh=m, **kw)  # noqa: E731
        if mesh == "data=2,model=4":
            assert int(run(stop_after=STEPS // 2)["step"]) == STEPS // 2
        got = run()
        assert int(got["step"]) == STEPS
        _close(one["params"], got["params"])
        _moments_sharded(got, m)
        assert _moved(one["params"], eagle.init_head(TOY, jax.random.key(1))) > 1e-2

    def test_onpolicy_training_on_a_mesh_equals_one_device(toy, tmp_path):
        """Two on-policy rounds (EAGLE-2, two passes; held-out scoring unrolls the head 3
        steps) decoded by the sharded target on data=2,model=4 (6 prompts a round and 6
        held out: padded to 8 rows for the decode, minibatches of 2 rows) store the same
        answers and reach the one-device parameters to 1e-5, with the optimizer state
        sharded."""
        from pathlib import Path

        from specjax.models.registry import LoadedModel
        from specjax.train import onpolicy, shards, ttt

        model, tp = toy
        lm = LoadedModel("toy", model, tp, toys.ByteTokenizer(V, limit=10), (0,), Path("toy"))
        cfg = onpolicy.OnPolicyConfig(rounds=2, batch=6, max_new_tokens=8, val_prompts=6,
                                      val_every=2, passes=2, batch_tokens=128, lr=1e-2,
                                      warmup=1, draft_vocab=48, seed=2,
                                      loss=ttt.LossConfig(k=1, noise=0.0))
        pool = [(f"toy#{i}", "ab " * (i % 3 + 1) + f"n{i}") for i in range(6 + 2 * 6)]
        vids = np.arange(48, dtype=np.int32)
        th = shards.target_hash(model.config, tp)

        def run(name, mesh=None):
            store = shards.ShardStore(tmp_path / f"s_{name}", onpolicy.store_header(
                lm, cfg, "none", th), V)
            st = onpolicy.train(lm, ttt.EAGLE2, cfg, tmp_path / name, store, pool, vids,
                                mesh=mesh)
            return st, [store.read(i) for i in range(len(store))]

        m = sharding.make_mesh(2, 4)
        one, data_one = run("one")
        got, data_got = run("mesh", m)
        assert int(got["step"]) == int(one["step"]) == 2 * 2 * 3  # rounds x passes x minibatches
        for a, b in zip(data_one, data_got, strict=True):  # the same answers, token for token
            assert [(t.tolist(), pl) for t, pl in a] == [(t.tolist(), pl) for t, pl in b]
        _close(one["params"], got["params"])
        _moments_sharded(got, m)
        assert _moved(one["params"], onpolicy.init_params(ttt.EAGLE2, TOY, cfg)) > 1e-2

    def test_sharding_notebook_executes(smollm, monkeypatch):
        """notebooks/06_sharding.ipynb on the 8 simulated devices it is written for."""
        from pathlib import Path

        import notebook_run

        path = Path(__file__).parent.parent / "notebooks" / "06_sharding.ipynb"
        monkeypatch.setattr("specjax.models.load", lambda *a, **k: smollm)
        ns = notebook_run.execute(path)
        notebook_run.check(path, ns)
        assert dict(ns["mesh"].shape) == {"data": 2, "model": 3}  # a real mesh, not 1 x 1
