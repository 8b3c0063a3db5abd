"""A user's own conversations as training data: ShareGPT and OpenAI JSON lines, a datasets
folder and parquet read alike; malformed input named by file and line (or row) before any
weights load; a seeded stream with bounded memory, process shards and a position that
resumes; the loss on the assistant's tokens; a corpus from them, and EAGLE training straight
from them, resumed mid-epoch to the uninterrupted run's parameters."""

from __future__ import annotations

import dataclasses
import json
import tracemalloc

import jax
import numpy as np
import pytest

import toys
from specjax.cli import main
from specjax.models.llama import Llama
from specjax.models.registry import encode as encode_text
from specjax.train import chat_corpus, distill
from specjax.train import conversations as conv
from specjax.train import eagle as train_eagle
from specjax.train import online

WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]


def _convs(n: int, seed: int = 0) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    say = lambda k: " ".join(rng.choice(WORDS, k))
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
        for _ in range(1 + i % 3):
            turns += [{"role": "user", "content": f"q{i} " + say(3)},
                      {"role": "assistant", "content": f"a{i} " + say(4)}]
        out.append(turns)
    return out


def _sharegpt(msgs):
    who = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"id": "x", "conversations": [{"from": who[m["role"]], "value": m["content"]}
                                         for m in msgs]}


def _openai(msgs):
    return {"messages": msgs}


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok():
    return toys.chat_tokenizer()


@dataclasses.dataclass
class ChatLM:
    """What the corpus builder reads of a ``LoadedModel``."""

    model: Llama
    params: dict
    tokenizer: object
    eos_ids: tuple = (3,)
    source: str = "toy/chat.gguf"
    has_chat_template: bool = True
    mesh: None = None

    def encode(self, text, chat=False):
        return encode_text(self.tokenizer, text, chat)


@pytest.fixture(scope="module")
def lm(tok):
    return ChatLM(Llama(toys.LLAMA_CHAT), toys.llama_params(2, 3.0, toys.LLAMA_CHAT), tok)


# ----------------------------------------------------------------------------- formats

def _datasets():
    import datasets

    datasets.disable_progress_bars()
    return datasets


def test_four_formats_read_the_same_conversations(tmp_path):
    datasets = _datasets()

    convs = _convs(10)
    a = conv.scan(_jsonl(tmp_path / "sg.jsonl", [_sharegpt(c) for c in convs]))
    b = conv.scan(_jsonl(tmp_path / "oa.jsonl", [_openai(c) for c in convs]))
    ds = datasets.Dataset.from_list([_openai(c) for c in convs])
    ds.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "pq").mkdir()
    datasets.Dataset.from_list([_sharegpt(c) for c in convs]).to_parquet(
        str(tmp_path / "pq" / "part-0.parquet"))
    c = conv.scan(tmp_path / "saved")
    d = conv.scan(tmp_path / "pq")
    read = [[m for _, m in sorted(conv.Stream(i, seed=3))] for i in (a, b, c, d)]
    assert read[0] == convs and all(r == convs for r in read)
    assert a.counts == b.counts == c.counts == d.counts
    assert a.counts["conversations"] == 10 and a.counts["assistant"] == 19


@pytest.mark.parametrize("line, says", [
    ("not json", "not JSON lines"),
    ("[1, 2]", "expected a JSON object"),
    ('{"text": "hi"}', "no 'conversations' (ShareGPT) or 'messages' (OpenAI) field"),
    ('{"messages": []}', "an empty conversation"),
    ('{"messages": [{"role": "user"}]}', "turn 0 lacks 'role' or 'content'"),
    ('{"messages": [{"role": "tool", "content": "x"}]}', "unknown role 'tool'"),
    ('{"conversations": [{"from": "human", "value": 3}]}', "'value' is not a string"),
])
def test_a_bad_line_is_named_by_file_and_line(tmp_path, line, says):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps(_openai(_convs(1)[0])) + "\n\n" + line + "\n")
    with pytest.raises(conv.DataError) as e:
        conv.scan(p)
    assert str(e.value).startswith(f"{p}:3: ") and says in str(e.value)
    assert "\n" not in str(e.value)


def test_other_files_and_rows_are_named(tmp_path):
    datasets = _datasets()

    (tmp_path / "c.txt").write_text("hello")
    with pytest.raises(conv.DataError, match=r"c\.txt: expected JSON lines"):
        conv.scan(tmp_path / "c.txt")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(conv.DataError, match="no conversations"):
        conv.scan(tmp_path / "e.jsonl")
    rows = [_openai(c) for c in _convs(3)] + [{"messages": [{"role": "robot", "content": "x"}]}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(conv.DataError, match=r"ds row 3: turn 0 has the unknown role 'robot'"):
        conv.scan(tmp_path / "ds")


def test_cli_refuses_bad_data_in_one_line_before_loading(tmp_path, no_model, capsys):
    bad = tmp_path / "chat.jsonl"
    bad.write_text(json.dumps(_openai(_convs(1)[0])) + "\n" + '{"messages": 5}\n')
    for argv in (["features", "--data", str(bad), "--out", str(tmp_path / "o")],
                 ["distill", "--data", str(bad), "--out", str(tmp_path / "o2")],
                 ["train", "eagle", "--data", str(bad), "--run", str(tmp_path / "r")],
                 ["train", "onpolicy", "--data", str(bad), "--run", str(tmp_path / "r2"),
                  "--shards", str(tmp_path / "s")]):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"specjax: error: {bad}:2: its turns are int, expected a list"]
    assert main(["features", "--data", str(bad), "--prompts", str(tmp_path),
                 "--out", str(tmp_path / "o3")]) == 2


# ----------------------------------------------------------------------------- the stream

def test_stream_is_seeded_sharded_and_resumes(tmp_path):
    index = conv.scan(_jsonl(tmp_path / "c.jsonl", [_openai(c) for c in _convs(50)]), window=8)
    assert len(index.starts) == 7
    order = [r for r, _ in conv.Stream(index, seed=1)]
    assert sorted(order) == list(range(50)) and order != list(range(50))
    assert order == [r for r, _ in conv.Stream(index, seed=1)]
    assert order != [r for r, _ in conv.Stream(index, seed=2)]
    two = [r for r, _ in conv.Stream(index, seed=1, epochs=2)]
    assert two[:50] == order and sorted(two[50:]) == sorted(order) and two[50:] != order
    shards = [[r for r, _ in conv.Stream(index, seed=1, shard=(p, 3))] for p in range(3)]
    assert sorted(sum(shards, [])) == list(range(50))
    assert all(abs(len(s) - 50 / 3) <= 7 for s in shards)
    for cut in (0, 5, 8, 23, 49):  # stop after `cut` records, reopen at the position
        s = conv.Stream(index, seed=1, shard=(1, 3), epochs=2)
        it = iter(s)
        head = [next(it)[0] for _ in range(min(cut, len(shards[1])))]
        rest = [r for r, _ in conv.Stream(index, seed=1, shard=(1, 3), epochs=2,
                                          position=s.position)]
        full = [r for r, _ in conv.Stream(index, seed=1, shard=(1, 3), epochs=2)]
        assert head + rest == full


def test_stream_memory_does_not_grow_with_the_file(tmp_path):
    rows = [_openai(c) for c in _convs(200)] * 40  # 8,000 conversations, about 2.5 MB
    p = _jsonl(tmp_path / "big.jsonl", rows)
    index = conv.scan(p, window=64)
    tracemalloc.start()
    n = sum(1 for _ in conv.Stream(index, seed=0))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert n == 8000 and p.stat().st_size > 2_000_000
    assert peak < 400_000, peak  # a window's records, not the file


# ----------------------------------------------------------------------------- rendering

def test_loss_covers_the_assistants_tokens(tok):
    msgs = _convs(3)[2]  # three exchanges
    r = conv.render(tok, msgs, 4096)
    assert list(r.tokens) == encode_text(tok, msgs[:-1], chat=True) + list(
        tok.encode(msgs[-1]["content"] + "<|im_end|>\n", add_special_tokens=False))
    runs, cur = [], []
    for t, m in zip(r.tokens, r.loss_mask):  # the masked runs of tokens, in order
        if m:
            cur.append(int(t))
        elif cur:
            runs, cur = runs + [cur], []
    runs += [cur] if cur else []
    answers = [m["content"] for m in msgs if m["role"] == "assistant"]
    want = [tok.encode(a + "<|im_end|>\n", add_special_tokens=False) for a in answers]
    assert runs == want  # each answer and its turn's end; nothing of the user's or system's
    every = conv.render(tok, msgs, 4096, loss="all")
    assert list(every.tokens) == list(r.tokens) and every.loss_mask[1:].all()
    cut = conv.render(tok, msgs, 40)
    assert cut.cut and len(cut.tokens) == 40 and list(cut.tokens) == list(r.tokens[:40])


def test_untrainable_conversations_are_counted_not_silently_dropped(tmp_path, tok):
    rows = [_openai(c) for c in _convs(4)] + [
        _openai([{"role": "user", "content": "no answer"}]),
        _openai([{"role": "assistant", "content": "a continuation"}]),
        _openai([{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "y"}])]
    index = conv.scan(_jsonl(tmp_path / "c.jsonl", rows))
    counts: dict = {}
    kept = list(conv.examples(conv.Stream(index), tok, 200, counts=counts))
    assert counts == {"read": 7, "kept": 4, "cut_at_max_len": 0, "dropped_no_answer": 2,
                      "dropped_no_answer_within_max_len": 1, "dropped_overlapping_exclude": 0}
    assert len(kept) == 4


def test_a_base_models_plain_turns(tmp_path):
    base = toys.chat_tokenizer(template=None)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    r = conv.render(base, msgs, 100, eos=3)
    assert base.decode(r.tokens[r.loss_mask.astype(bool)]).replace(" ", "") == "\n\nyo<|im_end|>"


# ----------------------------------------------------------------------------- training

def test_a_corpus_of_conversations_keeps_the_loss_mask(tmp_path, lm):
    index = conv.scan(_jsonl(tmp_path / "c.jsonl", [_sharegpt(c) for c in _convs(12)]))
    s = chat_corpus.build(lm, index, tmp_path / "corpus", max_tokens=10_000, max_len=160,
                          shard_tokens=600)
    corpus = distill.load_shards(tmp_path / "corpus")
    assert s["examples"] == len(corpus) == 12 and s["counts"]["kept"] == 12
    first = next(e for e in corpus if e.loss_mask is not None)
    stream = {tuple(r.tokens): r for _, r in conv.examples(conv.Stream(index), lm.tokenizer, 160)}
    assert np.array_equal(first.loss_mask, stream[tuple(first[0])].loss_mask)
    cfg = train_eagle.TrainConfig(batch_tokens=512, max_len=160)
    plan = train_eagle.batch_plan(corpus, cfg)
    toks, _, _, mask = train_eagle.batch_at(corpus, plan, 0, cfg)
    i = train_eagle.batch_indices(plan, 0, cfg.seed)[0]
    n = len(corpus[i][0])
    assert np.array_equal(mask[0, :n - 1], corpus[i].loss_mask[1:])
    again = chat_corpus.build(lm, index, tmp_path / "corpus", max_tokens=10_000, max_len=160,
                              shard_tokens=600)
    assert again["examples"] == 12 and again["seconds_this_run"] < s["seconds_this_run"] + 5


def test_onpolicy_prompts_from_conversations(tmp_path):
    from specjax.train import onpolicy

    convs = _convs(6)
    long = " ".join(f"word{i}" for i in range(20))  # a 13-word span to exclude
    convs[2][0]["content"] = long
    index = conv.scan(_jsonl(tmp_path / "c.jsonl", [_openai(c) for c in convs]))
    pool = onpolicy.conversation_pool(index, seed=0)
    assert len(pool) == sum(m["role"] == "user" for c in convs for m in c)
    pid, msgs = next(p for p in pool if p[0] == "data#2.4")  # record 2's third user turn
    assert msgs == convs[2][:5] and msgs[-1]["role"] == "user"
    assert len(onpolicy.conversation_pool(index, exclude=["so " + long])) == len(pool) - 3
    assert len(onpolicy.conversation_pool(index, max_prompt_tokens=10)) < len(pool)


def test_regenerated_answers_are_the_targets(tmp_path, lm):
    from specjax import generate

    convs = _convs(4)
    new, info = chat_corpus.regenerate(lm, convs, max_new_tokens=6, batch=3, max_len=512)
    assert info["answered"] == sum(m["role"] == "assistant" for c in convs for m in c)
    c = new[1]  # two exchanges: the second answer follows the target's first
    ids = lm.encode(c[:3], chat=True)
    want = generate(lm.model, lm.params, [ids], max_new_tokens=6, eos_ids=(3,)).to_lists()[0]
    assert c[3]["content"] == lm.tokenizer.decode([t for t in want if t != 3],
                                                  skip_special_tokens=True)
    assert c[1]["content"] != convs[1][1]["content"]


def test_training_on_conversations_resumes_mid_epoch_to_the_same_head(tmp_path, lm):
    index = conv.scan(_jsonl(tmp_path / "c.jsonl", [_openai(c) for c in _convs(30)]), window=8)
    cfg = train_eagle.TrainConfig(steps=6, batch_tokens=512, max_len=128, save_every=2,
                                  warmup=1, ce_vocab=32)
    kw = dict(target=lm.model, tparams=lm.params, tokenizer=lm.tokenizer, index=index, cfg=cfg,
              eos=3)
    whole = online.train(run_dir=tmp_path / "whole", **kw)
    counts: dict = {}
    part = online.train(run_dir=tmp_path / "part", stop_after=3, counts=counts, **kw)
    assert int(part["step"]) == 3 and 0 < counts["kept"] < 30  # stopped inside epoch 0
    pos = tuple(np.asarray(part["reader"]))
    assert pos[0] == 0 and pos != (0, 0, 0, 0)
    resumed = online.train(run_dir=tmp_path / "part", **kw)
    assert int(resumed["step"]) == 6
    assert np.array_equal(np.asarray(resumed["reader"]), np.asarray(whole["reader"]))
    for a, b in zip(jax.tree.leaves(whole["params"]), jax.tree.leaves(resumed["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(jax.tree.leaves(whole["params"])[0]),
                              np.asarray(jax.tree.leaves(part["params"])[0]))
