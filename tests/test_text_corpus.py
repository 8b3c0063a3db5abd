"""The fixed text corpus: reference pairs read from the training files, features equal to the
target's hidden states from one prefill, resumable shards, and EAGLE training on it (loss goes
down, resume gives the same parameters)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import toys
from specjax.models.llama import Llama, init_params
from specjax.train import distill, text_corpus
from specjax.train import eagle as train_eagle
from toys import assert_within_a_bf16_step

TOY = toys.LLAMA_TEXT
V = TOY.vocab_size


class _Tok:
    """Characters as token ids (1 + ord % 38); nothing special is added."""

    def encode(self, text, add_special_tokens=False):
        return [1 + ord(c) % (V - 2) for c in text]


@dataclasses.dataclass
class ToyLM:
    model: Llama
    params: dict
    eos_ids: tuple = (V - 1,)
    tokenizer: _Tok = dataclasses.field(default_factory=_Tok)
    source: str = "/some/where/toy.gguf"
    has_chat_template: bool = True

    def encode(self, text, chat=False):
        return [V - 1] * chat + self.tokenizer.encode(text)


@pytest.fixture(scope="module")
def lm():
    return ToyLM(Llama(TOY), jax.tree.map(lambda x: x * 3.0, init_params(TOY, jax.random.key(4))))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("prompts")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    say = lambda n: " ".join(rng.choice(words, n))
    (d / "gsm8k_train.jsonl").write_text("\n".join(json.dumps(
        {"question": say(8), "answer": f"{say(5)} <<2*3=6>>6 {say(4)}"}) for _ in range(12)))
    (d / "self_instruct_seed.jsonl").write_text("\n".join(json.dumps(
        {"instruction": say(6), "instances": [{"input": say(3), "output": say(9)}]})
        for _ in range(6)))
    (d / "t0").mkdir()
    (d / "t0" / "task.jsonl").write_text("\n".join(json.dumps(
        {"prompt": say(30), "completion": say(12)}) for _ in range(12)))
    return d


def test_reference_pairs_mix_sources_and_drop_excluded(data_dir):
    pairs, info = text_corpus.reference_pairs(data_dir)
    assert info["pairs"] == len(pairs) == 30
    assert not any("<<" in a for _, a in pairs)  # calculator annotations removed
    assert len({p for p, _ in pairs[:3]}) == 3
    long = next(p for p in pairs if len(p[0].split()) >= 13)  # overlap is 13-word spans
    excluded, info2 = text_corpus.reference_pairs(data_dir, exclude=[long[0]])
    assert info2["dropped_overlapping_exclude"] >= 1 and long not in excluded


def test_features_are_the_targets_hidden_states_and_shards_resume(lm, data_dir, tmp_path):
    pairs, _ = text_corpus.reference_pairs(data_dir)
    out = tmp_path / "corpus"
    s = text_corpus.build(lm, pairs, out, max_tokens=1500, max_len=96, batch_tokens=512,
                          shard_tokens=400)
    assert s["tokens"] >= 1500 and s["model"] == "toy.gguf" and "/" not in s["model"]
    shards = sorted(out.glob("shard_*.npz"))
    assert len(shards) >= 3
    corpus = distill.load_shards(out)
    for tok, pl, f in corpus[:4]:
        assert len(tok) <= 96 and 0 <= pl < len(tok) and tok[-1] == V - 1  # EOS ends it
        _, hid, _ = toys.forward(lm.model, lm.params, jnp.asarray(tok)[None])
        assert_within_a_bf16_step(f, hid[TOY.num_layers][0])
    stamp = shards[0].stat().st_mtime_ns
    shards[-1].unlink()  # an interrupted build: the missing shard alone is made again
    again = text_corpus.build(lm, pairs, out, max_tokens=1500, max_len=96, batch_tokens=512,
                              shard_tokens=400)
    assert shards[0].stat().st_mtime_ns == stamp and shards[-1].exists()
    assert again["tokens"] == s["tokens"]


CFG = train_eagle.TrainConfig(steps=24, batch_tokens=256, max_len=96, lr=1e-2, warmup=3,
                              save_every=6, seed=2, all_positions=True, ce_vocab=0)


@pytest.fixture(scope="module")
def text(lm, data_dir, tmp_path_factory):
    pairs, _ = text_corpus.reference_pairs(data_dir)
    out = tmp_path_factory.mktemp("text")
    text_corpus.build(lm, pairs, out, max_tokens=2000, max_len=96, batch_tokens=512)
    return distill.load_shards(out)


def test_all_positions_trains_on_the_prompt_too(text):
    plan = train_eagle.batch_plan(text, CFG)
    _, _, _, mask_all = train_eagle.batch_at(text, plan, 0, CFG)
    _, _, _, mask_ans = train_eagle.batch_at(text, plan, 0, dataclasses.replace(
        CFG, all_positions=False))
    assert mask_all.sum() > mask_ans.sum() > 0


def test_training_on_text_lowers_the_loss_and_resumes_exactly(lm, text, tmp_path):
    logs = []
    whole = train_eagle.train(lm.model, lm.params, text, CFG, tmp_path / "a", log=logs.append)
    first = np.mean([r["loss"] for r in logs[:4]])
    last = np.mean([r["loss"] for r in logs[-4:]])
    assert last < 0.8 * first, f"loss {first:.3f} -> {last:.3f}"
    train_eagle.train(lm.model, lm.params, text, CFG, tmp_path / "b", stop_after=9)
    resumed = train_eagle.train(lm.model, lm.params, text, CFG, tmp_path / "b")
    assert int(resumed["step"]) == CFG.steps
    for a, b in zip(jax.tree.leaves(whole["params"]), jax.tree.leaves(resumed["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
