"""Prompts the target writes itself (``specjax.train.self_prompts``), on a toy Llama with a
toy chat template: the opening and closing of a user turn come from the template; only
requests the target closed are kept, each once, none overlapping ``exclude``; a seed
gives the same file; ``read_prompts`` and ``prompt_pool`` read it as the source
``self_written``; a tokenizer without a chat template is refused."""

from __future__ import annotations

import dataclasses

import pytest

from specjax.core.decoding import generate
from specjax.train import distill, onpolicy, self_prompts
from toys import ByteTokenizer, loaded_llama


class ChatBytes(ByteTokenizer):
    """``ByteTokenizer`` with a chat template: ``<u>`` opens a user turn, ``close`` ends it."""

    chat_template = "toy"

    def __init__(self, vocab_size: int, close: str):
        super().__init__(vocab_size, limit=10_000)
        self.close = close

    def apply_chat_template(self, messages, tokenize=False, **kw):
        assert not tokenize
        return "".join(f"<u>{m['content']}{self.close}" for m in messages)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    base = loaded_llama(tmp_path_factory.mktemp("toy"), seed=5)
    opening = ByteTokenizer(128, 10_000).encode("<u>")
    # end the turn with a token the toy writes early when answering the opening, so that
    # sampled requests end often
    first = generate(base.model, base.params, [opening], max_new_tokens=4).to_lists()[0]
    close = chr(first[2] - 3)  # ByteTokenizer: byte b is id 3 + b
    return dataclasses.replace(base, tokenizer=ChatBytes(128, close))


def test_user_turn_comes_from_the_template(lm):
    tok = lm.tokenizer
    opening, close = self_prompts.user_turn(tok)
    assert opening == tok.encode("<u>") and close == tok.encode(tok.close)[0]
    with pytest.raises(ValueError, match="no chat template"):
        self_prompts.user_turn(ByteTokenizer(128))


def test_written_prompts_are_closed_unique_seeded_and_read_as_a_source(lm, tmp_path):
    kw = dict(batch=16, max_tokens=32, temperature=2.0)
    counts = self_prompts.write(lm, 12, tmp_path / "a", **kw)
    path = tmp_path / "a" / self_prompts.FILE
    kept = [r["prompt"] for r in distill.read_jsonl(path, ["prompt"])]
    assert counts["kept"] == len(kept) == 12 and len(set(kept)) == 12 and all(kept)
    # every row drawn was kept, dropped for a reason, or drawn after the 12th was kept
    surplus = counts["drawn"] - counts["kept"] - sum(
        counts[k] for k in ("unfinished", "empty", "duplicate", "overlapping"))
    assert 0 <= surplus < 16
    assert counts["unfinished"] > 0  # some rows ran to max_tokens and were dropped
    self_prompts.write(lm, 12, tmp_path / "b", **kw)
    assert (tmp_path / "b" / self_prompts.FILE).read_bytes() == path.read_bytes()
    self_prompts.write(lm, 12, tmp_path / "c", seed=1, **kw)
    assert (tmp_path / "c" / self_prompts.FILE).read_bytes() != path.read_bytes()

    long = next(p for p in kept if len(p.split()) >= distill.NGRAM)
    again = self_prompts.write(lm, 12, tmp_path / "d", exclude=[long], **kw)
    assert again["overlapping"] >= 1
    assert long not in (tmp_path / "d" / self_prompts.FILE).read_text()

    src = distill.read_prompts(tmp_path / "a")
    assert src["self_written"] == kept and src["gsm8k"] == []
    pool = onpolicy.prompt_pool(tmp_path / "a", sources=["self_written"])
    assert sorted(t for _, t in pool) == sorted(kept)
    assert all(i.startswith("self_written#") for i, _ in pool)
    with pytest.raises(FileNotFoundError, match="holds no prompt files"):
        distill.read_prompts(tmp_path / "empty")


def test_the_command_refuses_bad_counts_before_the_model_loads(tmp_path, capsys):
    from specjax import cli

    for flag in ("--n", "--batch"):
        assert cli.main(["self-prompts", "--model", str(tmp_path / "absent"), flag, "0",
                         "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and flag in err and "0" in err, err
    assert not (tmp_path / "o").exists()
