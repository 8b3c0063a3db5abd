"""Kernel-count statistics of a compiled XLA program (``compiled.as_text()``): how many
kernels (fusions, library calls, unfused ops) one execution launches, through calls, loop
bodies (times their known trip counts) and branches (the largest), and the loops,
conditionals and host transfers among them. ``hlo_stats`` reports them for a whole
program and for one iteration of its decoding loop; the device check uses it as a proxy of
a round's cost, and ``tests/test_round_kernels.py`` holds the rounds' sizes.
"""

from __future__ import annotations

import dataclasses
import re


#: instructions that launch nothing: views, tuples, parameters, constants, bookkeeping
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "opt-barrier", "partition-id", "replica-id", "add-dependency", "domain",
         "get-dimension-size", "iota"}
_HOST_OPS = {"infeed", "outfeed", "send", "recv", "send-done", "recv-done"}
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
                    r"=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def _opcode(line: str) -> str | None:
    """The opcode of one HLO instruction line (``%x = f32[2]{0} add(...)``), else None."""
    head, sep, rest = line.partition(" = ")
    if not sep or not head.lstrip().lstrip("ROOT ").startswith("%"):
        return None
    rest = rest.lstrip()
    if rest.startswith("("):  # a tuple type: skip its balanced parentheses
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                rest = rest[i + 1:]
                break
    else:
        rest = rest.split(" ", 1)[1] if " " in rest else ""
    m = re.match(r"\s*([\w\-$]+)\(", rest)
    return m.group(1) if m else None


def parse_hlo(text: str) -> tuple[dict[str, list[tuple[str, str]]], str]:
    """``({computation: [(opcode, line)]}, entry name)`` of an HLO module's text."""
    comps: dict[str, list[tuple[str, str]]] = {}
    entry, cur = None, None
    for line in text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{") and "->" in line:
            m = re.match(r"(ENTRY )?%?([\w.\-]+)", line)
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
        elif line.startswith("}"):
            cur = None
        elif cur is not None:
            op = _opcode(line)
            if op is not None:
                comps[cur].append((op, line))
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    return comps, entry


@dataclasses.dataclass
class Counts:
    """What one execution of a computation launches (loops at their known trip counts,
    else once; the largest branch of each conditional)."""

    kernels: int = 0  # fusions + library calls + unfused ops
    fusions: int = 0
    custom_calls: int = 0
    whiles: int = 0
    conditionals: int = 0
    host_transfers: int = 0
    loops_unknown_trip: int = 0  # loops without a known trip count (counted once)

    def add(self, o: "Counts", times: int = 1) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + times * getattr(o, f.name))


def _is_host(op: str, line: str) -> bool:
    return op in _HOST_OPS or (op == "custom-call" and "callback" in line.lower())


def count(comps: dict, name: str, _memo: dict | None = None) -> Counts:
    """``Counts`` of one execution of computation ``name`` (fusion bodies count as one
    kernel; calls, loop bodies and branches are followed)."""
    memo = {} if _memo is None else _memo
    if name in memo:
        return memo[name]
    c = Counts()
    for op, line in comps.get(name, []):
        if op in _FREE or op.endswith(("-done", "-update")) and not _is_host(op, line):
            continue
        if _is_host(op, line):
            c.host_transfers += 1
            c.kernels += 1
            continue
        if op == "fusion":
            c.kernels += 1
            c.fusions += 1
        elif op == "custom-call":
            c.kernels += 1
            c.custom_calls += 1
        elif op == "while":
            c.whiles += 1
            trip = _TRIP.search(line)
            body = re.search(r"\bbody=%([\w.\-]+)", line).group(1)
            cond = re.search(r"\bcondition=%([\w.\-]+)", line).group(1)
            n = int(trip.group(1)) if trip else 1
            c.loops_unknown_trip += trip is None
            c.add(count(comps, body, memo), n)
            c.add(count(comps, cond, memo), n + 1)
        elif op == "conditional":
            c.conditionals += 1
            m = _BRANCHES.search(line)
            names = (re.findall(r"%([\w.\-]+)", m.group(1)) if m else
                     re.findall(r"(?:true|false)_computation=%([\w.\-]+)", line))
            branches = [count(comps, b, memo) for b in names]
            if branches:
                c.add(max(branches, key=lambda b: b.kernels))
        elif op in ("call", "async-start") or op.endswith("-start"):
            for callee in _CALLS.findall(line):
                c.add(count(comps, callee, memo))
        else:  # an unfused op: a kernel of its own (copy, dot, sort, scatter, ...)
            c.kernels += 1
    memo[name] = c
    return c


def _top_whiles(comps: dict, name: str) -> list[str]:
    """The ``while`` lines of computation ``name`` in program order, through calls."""
    out = []
    for op, line in comps.get(name, []):
        if op == "while":
            out.append(line)
        elif op == "call":
            for callee in _CALLS.findall(line):
                out.extend(_top_whiles(comps, callee))
    return out


def hlo_stats(text: str) -> dict:
    """Kernel-count statistics of a compiled program (``compiled.as_text()``).

    ``program``: one execution of the entry computation. ``round``: one iteration of the
    decoding loop, the last top-level ``while`` (a decode program prefills, then loops,
    then packs its output): kernels per round, nested loops, conditionals (each one, like
    each loop iteration, reads a predicate on the host under XLA:GPU) and host transfers.
    ``host_transfers_in_module`` counts infeed/outfeed/send/recv and host callbacks
    anywhere in the module."""
    comps, entry = parse_hlo(text)
    out = {"program": dataclasses.asdict(count(comps, entry)), "round": None}
    loops = _top_whiles(comps, entry)
    if loops:
        line = loops[-1]
        body = re.search(r"\bbody=%([\w.\-]+)", line).group(1)
        cond = re.search(r"\bcondition=%([\w.\-]+)", line).group(1)
        r = count(comps, body)
        r = dataclasses.replace(r)
        r.add(count(comps, cond))
        out["round"] = dataclasses.asdict(r)
    out["host_transfers_in_module"] = sum(_is_host(op, line) for ops in comps.values()
                                          for op, line in ops)
    return out


__all__ = ["Counts", "count", "hlo_stats", "parse_hlo"]
