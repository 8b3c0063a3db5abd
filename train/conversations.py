"""A user's own chat conversations as training data: read, checked, streamed, rendered.

Formats (:func:`open_source`), as the field writes them:

- JSON lines with ShareGPT's ``{"conversations": [{"from", "value"}, ...]}``
  (``from``: ``human``/``user``, ``gpt``/``assistant``/``chatgpt``/``bing``/``bard``,
  ``system``);
- JSON lines with OpenAI-style ``{"messages": [{"role", "content"}, ...]}`` (``role``:
  ``system``, ``user``, ``assistant``);
- a Hugging Face ``datasets`` folder (``Dataset.save_to_disk``) or parquet files, either
  layout in a column, read with the ``datasets`` library (``pip install 'specjax[data]'``).

Every record is checked by :func:`scan` before any weights load: a record that is not a JSON
object, lacks its list, holds a turn without its fields or of an unknown role, or is an
empty conversation is a ``DataError`` of one line naming the file and line (or row).

:class:`Stream` reads a source in a seeded order with memory bounded by its window: the
records are cut into windows of ``window`` consecutive records (:func:`scan` keeps each
window's start, one integer per window), each epoch visits the windows in a seeded
permutation and each window's records in another, and process ``p`` of ``P`` takes every
``P``-th record of each window from the ``p``-th. Its :attr:`Stream.position` is four
integers; a trainer stores them in its Orbax checkpoint and ``Stream(..., position=...)``
continues at the next record, so a run killed mid-epoch resumes at the same example.

:func:`render` builds a conversation's tokens with the target's own chat template (plain
turns separated by blank lines for a base model without one) and marks the tokens the loss
covers: the assistant turns' (as SpecForge does), or all of them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from specjax._optional import MissingExtra

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
         "system": "system"}
"""Each accepted role (ShareGPT's ``from`` or OpenAI's ``role``) as the chat template's."""
EXTRA = "data"
WINDOW = 4096


class DataError(ValueError):
    """A conversation file, line or row that cannot be read as conversations (one line)."""


Message = dict  # {"role": "system" | "user" | "assistant", "content": str}


def parse_record(obj, where: str) -> list[Message]:
    """The messages of one record (ShareGPT's or OpenAI's layout); ``DataError`` naming
    ``where`` for anything else."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "conversations" in obj:
        turns, role_key, text_key = obj["conversations"], "from", "value"
    elif "messages" in obj:
        turns, role_key, text_key = obj["messages"], "role", "content"
    else:
        raise DataError(f"{where}: no 'conversations' (ShareGPT) or 'messages' (OpenAI) field")
    if not isinstance(turns, list):
        raise DataError(f"{where}: its turns are {type(turns).__name__}, expected a list")
    if not turns:
        raise DataError(f"{where}: an empty conversation")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or role_key not in t or text_key not in t:
            raise DataError(f"{where}: turn {i} lacks {role_key!r} or {text_key!r}")
        role = ROLES.get(str(t[role_key]).lower())
        if role is None:
            raise DataError(f"{where}: turn {i} has the unknown role {t[role_key]!r} "
                            f"(known: {', '.join(sorted(ROLES))})")
        if not isinstance(t[text_key], str):
            raise DataError(f"{where}: turn {i}'s {text_key!r} is not a string")
        out.append({"role": role, "content": t[text_key]})
    return out


# ----------------------------------------------------------------------------- sources

class JsonlSource:
    """A JSON-lines file read from byte offsets: ``records(pos, n)`` reads up to ``n``
    non-blank lines from offset ``pos``; memory holds those lines only."""

    def __init__(self, path: Path):
        self.path = path

    def where(self, i: int) -> str:
        return f"{self.path}:{i}"

    def records(self, pos: int, n: int, line: int = 1):
        """``(line number, object)`` of up to ``n`` records from offset ``pos`` (whose
        line is ``line``), and each record's end offset."""
        with open(self.path, "rb") as f:
            f.seek(pos)
            while n > 0:
                raw = f.readline()
                if not raw:
                    return
                here, line = line, line + 1
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise DataError(f"{self.where(here)}: not JSON lines "
                                    f"({getattr(e, 'msg', e)})") from None
                n -= 1
                yield here, obj, f.tell(), line


class RowSource:
    """A ``datasets.Dataset`` (memory-mapped Arrow): row ``i`` read on demand."""

    def __init__(self, path: Path, ds):
        self.path, self.ds = path, ds

    def where(self, i: int) -> str:
        return f"{self.path} row {i}"

    def records(self, pos: int, n: int, line: int = 0):
        for i in range(pos, min(pos + n, len(self.ds))):
            yield i, self.ds[i], i + 1, i + 1


def _datasets():
    try:
        import datasets
    except ImportError:
        raise MissingExtra("conversations in a datasets folder or parquet need the datasets "
                           f"library: pip install 'specjax[{EXTRA}]'") from None
    datasets.disable_progress_bars()
    return datasets


def open_source(path: str | Path):
    """The reader for ``path``: a ``.jsonl`` file, a ``.parquet`` file or a folder of them,
    or a ``datasets`` folder (``save_to_disk``; a ``DatasetDict``'s ``train`` split).
    ``DataError`` for anything else."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: no such file or folder")
    parquet = sorted(p.glob("*.parquet")) if p.is_dir() else [p] if p.suffix == ".parquet" else []
    if parquet:
        ds = _datasets().Dataset.from_parquet([str(f) for f in parquet])
        return RowSource(p, ds)
    if p.is_dir():
        if not (p / "dataset_info.json").exists() and not (p / "dataset_dict.json").exists():
            raise DataError(f"{p}: a folder without parquet files or a saved dataset "
                            "(Dataset.save_to_disk)")
        ds = _datasets().load_from_disk(str(p))
        if hasattr(ds, "keys"):  # a DatasetDict
            if "train" not in ds:
                raise DataError(f"{p}: a DatasetDict without a 'train' split "
                                f"(it has {', '.join(ds.keys())})")
            ds = ds["train"]
        return RowSource(p, ds)
    if p.suffix not in (".jsonl", ".ndjson"):
        raise DataError(f"{p}: expected JSON lines (.jsonl), parquet or a datasets folder")
    return JsonlSource(p)


@dataclasses.dataclass(frozen=True)
class Index:
    """What :func:`scan` learnt of a source: its records, each window's start (a byte
    offset or row, and its line), and the counts of roles and turns."""

    path: str
    records: int
    window: int
    starts: tuple[tuple[int, int], ...]
    counts: dict


def scan(path: str | Path, window: int = WINDOW) -> Index:
    """Checks every record of ``path`` (``parse_record``: the first bad one is a
    ``DataError`` naming its line or row) and indexes its windows, reading it once with
    memory bounded by one record. ``DataError`` for a source without records."""
    src = open_source(path)
    starts, n, pos, line = [], 0, 0, 1
    counts = {"turns": 0, "user": 0, "assistant": 0, "system": 0, "chars": 0}
    while True:
        got = 0
        for here, obj, end, nxt in src.records(pos, window, line):
            if got == 0:
                starts.append((pos, line))
            for m in parse_record(obj, src.where(here)):
                counts["turns"] += 1
                counts[m["role"]] += 1
                counts["chars"] += len(m["content"])
            got, pos, line = got + 1, end, nxt
        n += got
        if got < window:
            break
    if n == 0:
        raise DataError(f"{path}: no conversations")
    return Index(str(path), n, window, tuple(starts), {"conversations": n, **counts})


# ----------------------------------------------------------------------------- streaming

class Stream:
    """Records of a scanned source, ``(record number, messages)``, in a seeded order.

    Epoch ``e`` visits the windows in the permutation drawn from ``(seed, e)`` and the
    records of window ``w`` in the one drawn from ``(seed, e, w)``; ``shard=(p, P)``
    keeps the records ``p, p + P, ...`` of each permuted window. :attr:`position` is
    ``(epoch, window, record, 0)``: the next record this stream yields is record ``record``
    of this shard's part of the ``window``-th window of ``epoch``. ``epochs=None`` repeats
    without end."""

    def __init__(self, index: Index, seed: int = 0, shard: tuple[int, int] = (0, 1),
                 position: Sequence[int] = (0, 0, 0, 0), epochs: int | None = 1):
        p, count = shard
        if not (count >= 1 and 0 <= p < count):
            raise ValueError(f"shard {shard}: expected (index, count) with 0 <= index < count")
        self.index, self.seed, self.shard, self.epochs = index, seed, (p, count), epochs
        self.position = tuple(int(x) for x in position[:3]) + (0,)
        self.src = open_source(index.path)

    def _window(self, e: int, w: int) -> list[tuple[int, list[Message]]]:
        order = np.random.default_rng((self.seed, e)).permutation(len(self.index.starts))
        k = int(order[w])
        pos, line = self.index.starts[k]
        recs = [(k * self.index.window + j, obj, here) for j, (here, obj, _, _) in
                enumerate(self.src.records(pos, self.index.window, line))]
        perm = np.random.default_rng((self.seed, e, k)).permutation(len(recs))
        p, count = self.shard
        return [(recs[i][0], parse_record(recs[i][1], self.src.where(recs[i][2])))
                for i in perm[p::count]]

    def _next(self, e: int, w: int) -> tuple[int, int, int]:
        """The position at the start of the window after window ``w`` of epoch ``e``."""
        return (e, w + 1, 0) if w + 1 < len(self.index.starts) else (e + 1, 0, 0)

    def __iter__(self) -> Iterator[tuple[int, list[Message]]]:
        e, w, r, _ = self.position
        while self.epochs is None or e < self.epochs:
            part = self._window(e, w)
            for i in range(r, len(part)):
                nxt = (e, w, i + 1) if i + 1 < len(part) else self._next(e, w)
                self.position = nxt + (0,)
                yield part[i]
            e, w, r = self._next(e, w)
            self.position = (e, w, r, 0)


# ----------------------------------------------------------------------------- rendering

@dataclasses.dataclass(frozen=True)
class Rendered:
    """A conversation's tokens, and which of them the loss covers (uint8 per token)."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    cut: bool  # the conversation ran past max_len and was cut there


def trainable(msgs: Sequence[Message]) -> list[Message]:
    """The conversation up to its last assistant turn, without leading assistant turns
    (a split conversation's continuation); empty when no assistant turn follows a user
    turn."""
    out = list(msgs)
    first_user = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
    if first_user is None:
        return []
    head = [m for m in out[:first_user] if m["role"] == "system"]
    out = head + out[first_user:]
    last = max((i for i, m in enumerate(out) if m["role"] == "assistant"), default=-1)
    return out[:last + 1]


def _template(tokenizer, msgs, gen: bool) -> list[int]:
    return list(tokenizer.apply_chat_template(list(msgs), add_generation_prompt=gen,
                                              tokenize=True, return_dict=False))


def _chat_pieces(tokenizer, msgs: Sequence[Message]) -> list[tuple[list[int], bool]]:
    """``(tokens, is_assistant)`` pieces whose concatenation is the template's rendering:
    the rendering before each assistant turn (with the generation prompt), then the turn.
    ``DataError`` when the template does not render a conversation's turns as prefixes of
    the whole (then the loss cannot be placed on the assistant's tokens: use all)."""
    pieces, done = [], []
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        for seq, mine in ((_template(tokenizer, msgs[:k], True), False),
                          (_template(tokenizer, msgs[:k + 1], False), True)):
            if seq[:len(done)] != done:
                raise DataError("the chat template does not render earlier turns as a prefix "
                                "of later ones, so the assistant's tokens cannot be found: "
                                "train on all tokens (--loss all)")
            pieces.append((seq[len(done):], mine))
            done = seq
    return pieces


def _plain_pieces(tokenizer, msgs: Sequence[Message], eos: int | None):
    """Pieces of a base model's plain rendering: BOS, the turns' texts joined by blank
    lines, EOS after the last (an assistant turn)."""
    bos = tokenizer.encode("", add_special_tokens=True)
    pieces = [(list(bos), False)]
    for k, m in enumerate(msgs):
        text = ("\n\n" if k else "") + m["content"].strip()
        pieces.append((list(tokenizer.encode(text, add_special_tokens=False)),
                       m["role"] == "assistant"))
    if eos is not None:
        pieces[-1] = (pieces[-1][0] + [eos], pieces[-1][1])
    return pieces


def render(tokenizer, msgs: Sequence[Message], max_len: int, loss: str = "assistant",
           eos: int | None = None) -> Rendered | None:
    """The conversation (:func:`trainable` part) in the tokenizer's chat template (plain
    text without one), its first ``max_len`` tokens, with the loss on the assistant
    turns' tokens (``loss="assistant"``: the template's end-of-turn token included) or on
    every token (``"all"``). None when nothing is left to train on."""
    if loss not in ("assistant", "all"):
        raise ValueError(f"loss={loss!r}: expected 'assistant' or 'all'")
    msgs = trainable(msgs)
    if not msgs:
        return None
    if getattr(tokenizer, "chat_template", None):
        if loss == "all":
            pieces = [(_template(tokenizer, msgs, False), True)]
        else:
            pieces = _chat_pieces(tokenizer, msgs)
    else:
        pieces = _plain_pieces(tokenizer, msgs, eos)
        if loss == "all":
            pieces = [(p, True) for p, _ in pieces]
    toks = np.asarray([t for p, _ in pieces for t in p], np.int32)
    mask = np.asarray([int(a) for p, a in pieces for _ in p], np.uint8)
    cut = len(toks) > max_len
    toks, mask = toks[:max_len], mask[:max_len]
    mask[0] = 0  # nothing predicts the first token
    if not mask.any():
        return None
    return Rendered(toks, mask, cut)


def examples(stream: Stream, tokenizer, max_len: int, loss: str = "assistant",
             eos: int | None = None, counts: dict | None = None,
             banned: set | None = None) -> Iterator[tuple[int, Rendered]]:
    """``(record number, Rendered)`` for each record of ``stream`` that leaves something
    to train on; ``counts`` (a dict, updated in place) says how many were read, kept,
    cut at ``max_len``, and dropped: with no assistant turn after a user turn, with none
    within ``max_len``, or overlapping ``banned`` (13-word spans of excluded texts)."""
    from specjax.train import distill

    c = counts if counts is not None else {}
    for key in ("read", "kept", "cut_at_max_len", "dropped_no_answer",
                "dropped_no_answer_within_max_len", "dropped_overlapping_exclude"):
        c.setdefault(key, 0)
    for rec, msgs in stream:
        c["read"] += 1
        if banned and any(not banned.isdisjoint(distill.ngrams(m["content"])) for m in msgs):
            c["dropped_overlapping_exclude"] += 1
            continue
        if not trainable(msgs):
            c["dropped_no_answer"] += 1
            continue
        r = render(tokenizer, msgs, max_len, loss, eos)
        if r is None:
            c["dropped_no_answer_within_max_len"] += 1
            continue
        c["kept"] += 1
        c["cut_at_max_len"] += int(r.cut)
        yield rec, r


def prompts(index: Index, seed: int = 0, multi_turn: bool = True
            ) -> list[tuple[str, list[Message]]]:
    """Every user turn that an answer follows, as ``(id, messages up to it)``: prompts
    for the target to answer (``train onpolicy --data``). Ids are ``data#<record>.<turn>``;
    the order is the stream's (seeded)."""
    out = []
    for rec, msgs in Stream(index, seed):
        msgs = trainable(msgs)
        for k, m in enumerate(msgs):
            if (m["role"] == "user" and k + 1 < len(msgs) and msgs[k + 1]["role"] == "assistant"
                    and (multi_turn or not any(x["role"] == "user" for x in msgs[:k]))):
                out.append((f"data#{rec}.{k}", msgs[:k + 1]))
    return out


__all__ = ["DataError", "Index", "ROLES", "Rendered", "Stream", "examples", "open_source",
           "parse_record", "prompts", "render", "scan", "trainable"]
