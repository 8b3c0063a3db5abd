"""Expected latency of a hierarchical speculative decoding (HSD) hierarchy, and the optimum.

Setting. Models ``0..K`` cheapest first; ``K`` is the target. A hierarchy ``sigma =
(s_0 < ... < s_m = K)`` with one threshold ``T[k] >= 1`` per non-target level runs
Algorithm 1 (``specjax.hsd``): ``s_0`` drafts ``T[0]`` tokens (``T[0]`` forwards); a level
``s_k`` (``k >= 1``, the target included) calls ``s_{k-1}`` until its buffer holds at least
``T[k-1]`` tokens, verifies the whole buffer in one forward and returns ``accepted + 1``.
Acceptances are IID Bernoulli(``alpha[i][j]``) until the first rejection.

Two latency models (expected cost per token emitted by the target):

* ``"paper"`` -- Corollary 3.1 of the paper: ``L = [c_K + g_{m-1}(c_{s_{m-1}} + g_{m-2}(...
  + g_1(c_{s_1} + T_0 c_{s_0})))] / E(alpha_{s_{m-1}K}, T_{m-1})``, with ``E(a, n) = (1 -
  a^(n+1)) / (1 - a)`` and ``g_k = gamma(alpha_{s_{k-1}s_k}, T_{k-1}, T_k)`` computed exactly
  (renewal DP, :func:`gamma`) under the assumption that every buffer holds exactly its
  threshold. It is Markov in ``(model, T)``, hence optimisable in polynomial time.
* ``"exact"`` -- the exact expectation under IID: each target round is a renewal cycle, so
  ``L = E[cycle cost] / E[cycle tokens]``; every level's call cost follows Wald's identity
  and the *distribution* of every buffer (overshoot beyond ``T``) is carried up the chain:
  a level's buffer size sets how many tokens it returns, and the target's buffer size sets
  the denominator. The paper model ignores both overshoots; it is exact for two levels and
  an upper bound of ``"exact"`` otherwise (larger buffers only return more tokens).

Measured (``tests/test_hierarchy.py``, ``scripts/``). Monte-Carlo (:func:`simulate`, 4e5
tokens) agrees with ``"exact"`` within 1.3 standard errors (< 0.15 %) on every hierarchy
tried. ``"paper"`` exceeds the simulation by 0 % for two levels and, for Table 8's models,
by 6.6 % for ``(4,5,6), T=(3,4)``, 8.4 % for ``(3,4,5,6), T=(3,4,5)`` and 11.9 % for
``T=(5,3,4)``; on random deeper hierarchies by up to 50 %, so use ``"exact"`` to predict.
Paper tables (optimum over ``T <= 15`` with the n most expensive models): the 1- and
2-model rows are exact in both models (33.00, 14.37; 33.00, 19.31). Rows with 3..6 models,
printed Table 1 10.89 10.64 10.63 10.61 and Table 8 15.45 14.61 14.46 14.40:
``"paper"`` gives 11.21 10.66 10.64 10.62 (+2.9 +0.2 +0.0 +0.1 %) and 17.10 15.58 15.52
15.52 (+10.7 +6.7 +7.3 +7.8 %); ``"exact"`` gives 10.67 10.11 10.09 10.07 (-2.0 -4.9 -5.1
-5.1 %) and 16.02 14.23 14.13 14.13 (+3.7 -2.6 -2.3 -1.9 %). The paper estimated gamma
empirically for these tables; its Table 9 (three models, analytic setting) is reproduced by
``"paper"`` in 85 of 90 cells to the printed 0.01 (``benchmarks/plot_table9.py``).

Optimisers (:func:`optimal_hierarchy`), all exact for the model they optimise:
``"dp"`` (Bellman recursion over ``(model, T)`` states, ``O(K^2 t^2)``, ``"paper"`` only),
``"lp"`` (a generalized-shortest-path LP solved by HiGHS, ``"paper"`` only: our
reconstruction of Section 3.3, nodes ``(model, T)`` with multipliers ``gamma`` and
``1/E``, see :func:`_gsp_arcs`; the paper's Table 2 was not available to compare) and
``"brute"`` (enumeration, both models; the only exact optimiser of ``"exact"``, whose value
depends on the whole chain below a level, not on ``(model, T)`` alone). With ``t_max =
15`` on a busy 2-core CPU (``benchmarks/hsd_solver_bench.py``): K = 42, dp 0.016 s, lp 2.5 s;
K = 80, dp 0.07 s, lp 10 s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Sequence

import numpy as np

Model = Literal["paper", "exact"]
Method = Literal["dp", "lp", "brute"]
MAX_BRUTE = 5_000_000  # hierarchies; brute force refuses larger instances


# ----------------------------------------------------------------------------- inputs

def check_instance(costs: Sequence[float], alpha, t_max: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Validated ``(costs, alpha)`` as float arrays; ``alpha`` is read only where ``i < j``.

    Raises ``ValueError`` for a non-positive or non-finite cost, a shape mismatch, a
    missing pair (``None``/NaN with ``i < j``), an acceptance outside ``[0, 1]`` and
    ``t_max < 1`` (or not an int)."""
    c = np.asarray(costs, dtype=float)
    if c.ndim != 1 or c.size < 1:
        raise ValueError(f"costs must be a non-empty 1-D sequence, got shape {c.shape}")
    if not np.all(np.isfinite(c)) or np.any(c <= 0):
        raise ValueError(f"costs must be finite and positive, got {c.tolist()}")
    n = c.size
    try:
        raw = np.array(alpha, dtype=object)
    except ValueError as e:  # ragged nesting
        raise ValueError(f"alpha must be a {n}x{n} array: {e}") from None
    if raw.shape != (n, n):
        raise ValueError(f"alpha must have shape ({n}, {n}) to match costs, got {raw.shape}")
    a = np.zeros((n, n))
    for i, j in zip(*np.triu_indices(n, 1)):
        a[i, j] = _rate(raw[i, j], i, j)
    if t_max is not None and (isinstance(t_max, bool) or not isinstance(t_max, (int, np.integer))
                              or t_max < 1):
        raise ValueError(f"t_max must be an int >= 1, got {t_max!r}")
    return c, a


def _rate(x, i: int, j: int) -> float:
    """``alpha[i][j]`` as a float in ``[0, 1]``; ``ValueError`` if missing or outside."""
    try:
        v = math.nan if x is None else float(x)
    except (TypeError, ValueError):
        raise ValueError(f"alpha[{i}][{j}] = {x!r} is not a number") from None
    if math.isnan(v):
        raise ValueError(f"alpha[{i}][{j}] is missing (None/NaN)")
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"alpha[{i}][{j}] = {v} is outside [0, 1]")
    return v


def _check_hierarchy(n_models: int, sigma: Sequence[int], T: Sequence[int]
                     ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``sigma`` strictly increasing, ending with the target; one ``T >= 1`` per draft."""
    s, t = tuple(int(x) for x in sigma), tuple(int(x) for x in T)
    if not s or s[-1] != n_models - 1 or s[0] < 0 or any(b <= a for a, b in zip(s, s[1:])):
        raise ValueError(f"sigma must increase strictly and end with {n_models - 1}, got {s}")
    if len(t) != len(s) - 1 or any(x < 1 for x in t):
        raise ValueError(f"T needs one value >= 1 per non-target level of {s}, got {t}")
    return s, t


# --------------------------------------------------------- IID verification, renewals

def expected_tokens(alpha: float | np.ndarray, n: int | np.ndarray) -> np.ndarray | float:
    """``E(alpha, n) = (1 - alpha^(n+1)) / (1 - alpha)``: expected ``accepted + 1`` when
    ``n`` IID drafts are verified (``n + 1`` at ``alpha = 1``)."""
    a, n = np.asarray(alpha, float), np.asarray(n, float)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.where(a < 1, (1 - a ** (n + 1)) / np.where(a < 1, 1 - a, 1), n + 1)
    return float(e) if e.ndim == 0 else e


def _renewal(surv_r: np.ndarray, t: int) -> np.ndarray:
    """``u[..., s] = P(partial sums of IID returns hit s)``, ``s < t``, from the survival
    function ``surv_r[..., r] = P(R >= r)`` (``R >= 1``). ``sum(u[:T])`` is the expected
    number of calls needed to collect at least ``T`` tokens."""
    p = surv_r[..., :-1] - surv_r[..., 1:]
    u = np.zeros(surv_r.shape[:-1] + (t,))
    u[..., 0] = 1.0
    for s in range(1, t):
        r = np.arange(1, min(s, p.shape[-1] - 1) + 1)
        u[..., s] = np.sum(p[..., r] * u[..., s - r], axis=-1)
    return u


def _buffer_surv(u: np.ndarray, surv_r: np.ndarray, overshoot: bool) -> np.ndarray:
    """``S[..., T-1, b] = P(buffer >= b)`` for every threshold ``T = 1..t`` (``t = u.shape[-1]``):
    the sum of IID returns when it first reaches ``T``; without ``overshoot`` it is ``T``."""
    t, L = u.shape[-1], surv_r.shape[-1]
    b = np.arange(t + L - 1)
    step = (b[None, :] <= np.arange(1, t + 1)[:, None]).astype(float)
    if not overshoot:
        return np.broadcast_to(step, u.shape[:-1] + step.shape)
    shifted = np.zeros(u.shape + (t + L - 1,))
    for s in range(t):
        shifted[..., s, s:s + L] = u[..., s, None] * surv_r
    return np.maximum(step, np.cumsum(shifted, axis=-2) * (1 - step))


def _returned_surv(alpha: float, surv_b: np.ndarray, alpha0: float = 0.0, h: int = 0
                   ) -> np.ndarray:
    """``P(R >= r)`` for ``R = accepted + 1``: ``alpha^(r-1) P(buffer >= r-1)``, ``r >= 1``.

    With ``h > 0`` (the horizontal heuristic) ``h`` more drafts follow a buffer of ``b``,
    each accepted at rate ``alpha0`` once all ``b`` were: ``P(R >= r | b) = alpha^b
    alpha0^(r-1-b)`` for ``b < r - 1 <= b + h``."""
    n = surv_b.shape[-1]
    j = np.arange(n)
    out = np.zeros(surv_b.shape[:-1] + (n + h + 1,))
    out[..., 0] = 1.0
    out[..., 1:n + 1] = alpha ** j * surv_b
    if h:
        pb = surv_b - np.concatenate([surv_b[..., 1:], np.zeros_like(surv_b[..., :1])], -1)
        b, r1 = j[:, None], np.arange(n + h)[None, :]  # r1 = r - 1
        tail = np.where((r1 > b) & (r1 <= b + h), alpha ** b * alpha0 ** np.maximum(r1 - b, 0),
                        0.0)                                           # (b, r - 1)
        out[..., 1:] += pb @ tail
    return out


def gamma(alpha: float, t_low: int, t_high: int) -> float:
    """Expected number of calls to a level whose buffer holds exactly ``t_low`` drafts
    verified at rate ``alpha`` (each call returns ``accepted + 1`` tokens) until at least
    ``t_high`` tokens are collected. Exact (renewal DP); ``gamma(a, t, 1) = 1``."""
    surv_b = (np.arange(t_low + 2) <= t_low).astype(float)
    return float(np.sum(_renewal(_returned_surv(alpha, surv_b), t_high)))


# ------------------------------------------------------------------ latency models

def _bottom(cost: float) -> tuple[np.ndarray, np.ndarray]:
    """The bottom level as one forward per call returning one token: filling ``T[0]``
    then takes exactly ``T[0]`` calls and the buffer holds exactly ``T[0]`` drafts."""
    return np.array([cost]), np.array([[1.0, 1.0, 0.0]])


def _level_up(ec: np.ndarray, surv_r: np.ndarray, t: int, overshoot: bool
              ) -> tuple[np.ndarray, np.ndarray]:
    """For each state (call cost ``ec``, returns ``surv_r``) and threshold ``T = 1..t``: the
    expected calls to fill the buffer and ``P(buffer >= b)``; shapes ``(n, t)``, ``(n, t, L)``."""
    u = _renewal(surv_r, t)
    return np.cumsum(u, axis=-1), _buffer_surv(u, surv_r, overshoot)


def _value(c: np.ndarray, a: np.ndarray, sigma: tuple[int, ...], T: tuple[int, ...],
           overshoot: bool, h: int = 0, c_h: float = 0.0) -> float:
    """Latency of one hierarchy, with (``"exact"``) or without (``"paper"``) overshoot;
    ``h``, ``c_h``: the horizontal heuristic's tokens per verification and their cost."""
    if len(sigma) == 1:
        return float(c[sigma[0]])
    ec, surv_r = _bottom(c[sigma[0]])
    for k in range(1, len(sigma)):
        calls, surv_b = _level_up(ec, surv_r, T[k - 1], overshoot)
        hk = h if k >= 2 else 0
        ec = c[sigma[k]] + calls[:, -1] * ec + (c_h if hk else 0.0)
        surv_r = _returned_surv(a[sigma[k - 1], sigma[k]], surv_b[:, -1],
                                a[sigma[0], sigma[k]], hk)
    return float(ec[0] / np.sum(surv_r[0, 1:]))


def latency(costs: Sequence[float], alpha, sigma: Sequence[int], T: Sequence[int], *,
            model: Model = "paper", horizontal: int = 0,
            horizontal_cost: float | None = None) -> float:
    """Expected cost per target token of hierarchy ``sigma`` with thresholds ``T``.

    ``model="paper"``: the paper's closed form with exact gamma (see module docstring);
    ``model="exact"``: the exact IID expectation, overshoot included (what :func:`simulate`
    estimates). Both agree for one or two levels. ``horizontal = h``: every level ``k >= 2``
    also verifies ``h`` drafts of the bottom level (accepted at ``alpha[s_0][s_k]``, at
    ``horizontal_cost`` per verification, default ``h * costs[s_0]``), as
    ``specjax.hsd.Hierarchy(horizontal=h)`` runs. Raises ``ValueError`` on bad input."""
    c, a = check_instance(costs, alpha)
    s, t = _check_hierarchy(c.size, sigma, T)
    h = _check_horizontal(horizontal)
    c_h = h * c[s[0]] if horizontal_cost is None else float(horizontal_cost)
    return _value(c, a, s, t, _overshoot(model), h, c_h)


def _check_horizontal(h) -> int:
    if isinstance(h, bool) or not isinstance(h, (int, np.integer)) or h < 0:
        raise ValueError(f"horizontal must be an int >= 0, got {h!r}")
    return int(h)


def _overshoot(model: str) -> bool:
    if model not in ("paper", "exact"):
        raise ValueError(f"model must be 'paper' or 'exact', got {model!r}")
    return model == "exact"


# --------------------------------------------------------------------- simulation

@dataclasses.dataclass(frozen=True)
class SimResult:
    """Monte-Carlo estimate of Algorithm 1. ``latency`` = total cost / total tokens, with its
    delta-method standard error over target rounds. Per level ``k`` of ``sigma``:
    ``forwards[k]``, and for ``k >= 1`` ``gamma[k]`` (calls to level ``k-1`` per fill),
    ``overshoot[k]`` (mean buffer size minus ``T[k-1]``); index 0 of the last two is 0."""

    latency: float
    stderr: float
    tokens: int
    rounds: int
    forwards: tuple[int, ...]
    gamma: tuple[float, ...]
    overshoot: tuple[float, ...]


class _Sim:
    """Vectorised recursion: ``calls_of(k, n)`` runs ``n`` independent calls of level ``k``."""

    def __init__(self, c, a, sigma, T, rng, h=0):
        self.c, self.a, self.s, self.T, self.rng, self.h = c, a, sigma, T, rng, h
        m = len(sigma)
        self.forwards, self.fills = np.zeros(m, np.int64), np.zeros(m, np.int64)
        self.calls, self.excess = np.zeros(m, np.int64), np.zeros(m, np.int64)

    def calls_of(self, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens returned (``accepted + 1``; ``T[0]`` at the bottom) and cost, per call."""
        if k == 0:
            self.forwards[0] += n * self.T[0]
            return np.full(n, self.T[0]), np.full(n, self.T[0] * self.c[self.s[0]])
        need, buf, cost = self.T[k - 1], np.zeros(n, np.int64), np.zeros(n)
        idx = np.arange(n)
        while idx.size:
            r, cst = self.calls_of(k - 1, idx.size)
            buf[idx] += r
            cost[idx] += cst
            self.calls[k] += idx.size
            idx = idx[buf[idx] < need]
        self.fills[k] += n
        self.excess[k] += int(np.sum(buf - need))
        self.forwards[k] += n
        acc = self._accept(self.a[self.s[k - 1], self.s[k]], buf)
        if self.h and k >= 2:  # the horizontal heuristic: h bottom drafts follow the buffer
            more = self._accept(self.a[self.s[0], self.s[k]], np.full(n, self.h))
            acc = acc + np.where(acc == buf, more, 0)
            cost = cost + self.h * self.c[self.s[0]]
        return acc + 1, cost + self.c[self.s[k]]

    def _accept(self, alpha: float, buf: np.ndarray) -> np.ndarray:
        """Accepted drafts: IID Bernoulli(alpha) until the first rejection, at most ``buf``
        (the run of successes is geometric, drawn in one call)."""
        if alpha >= 1.0:
            return buf
        return np.minimum(self.rng.geometric(1.0 - alpha, buf.size) - 1, buf)


def simulate(costs: Sequence[float], alpha, sigma: Sequence[int], T: Sequence[int],
             n_tokens: int, seed: int = 0, horizontal: int = 0) -> SimResult:
    """Runs Algorithm 1 with Bernoulli acceptances until the target emitted ``>= n_tokens``
    tokens (whole rounds), with ``horizontal`` as in :func:`latency` (each of those drafts
    costing ``costs[s_0]``). Deterministic for a given ``seed``."""
    c, a = check_instance(costs, alpha)
    s, t = _check_hierarchy(c.size, sigma, T)
    h = _check_horizontal(horizontal)
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)) or n_tokens < 1:
        raise ValueError(f"n_tokens must be an int >= 1, got {n_tokens!r}")
    if len(s) == 1:
        return SimResult(float(c[-1]), 0.0, int(n_tokens), int(n_tokens), (int(n_tokens),),
                         (0.0,), (0.0,))
    sim, toks, costs_ = _Sim(c, a, s, t, np.random.default_rng(seed), h), [], []
    batch = max(64, int(n_tokens / max(1.0, expected_tokens(a[s[-2], s[-1]], t[-1]))) // 4)
    while sum(int(x.sum()) for x in toks) < n_tokens:
        r, cst = sim.calls_of(len(s) - 1, batch)
        toks.append(r)
        costs_.append(cst)
    x, y = np.concatenate(costs_), np.concatenate(toks).astype(float)
    lat = x.sum() / y.sum()
    se = float(np.std(x - lat * y) / (np.mean(y) * math.sqrt(x.size)))
    fills = np.maximum(sim.fills, 1)
    return SimResult(float(lat), se, int(y.sum()), int(x.size), tuple(int(f) for f in sim.forwards),
                     tuple((sim.calls / fills).tolist()), tuple((sim.excess / fills).tolist()))


# ------------------------------------------------------------------- optimisation

def gamma_table(alpha: np.ndarray, t_max: int) -> np.ndarray:
    """``G[i, j, t_low-1, t_high-1] = gamma(alpha[i][j], t_low, t_high)`` for all ``i < j``
    (0 elsewhere), vectorised; closed-form truncated-geometric returns, renewal DP."""
    n = alpha.shape[0]
    iu = np.triu_indices(n, 1)
    a = alpha[iu][:, None, None]                                   # (P, 1, 1)
    t_low = np.arange(1, t_max + 1)[None, :, None]                 # (1, t, 1)
    r = np.arange(t_max + 2)[None, None, :]                        # P(R >= r) = a^(r-1)
    surv = np.where(r == 0, 1.0, np.where(r - 1 <= t_low, a ** np.maximum(r - 1, 0), 0.0))
    G = np.zeros((n, n, t_max, t_max))
    G[iu] = np.cumsum(_renewal(surv, t_max), axis=-1)
    return G


def optimal_hierarchy(costs: Sequence[float], alpha, t_max: int, *, method: Method = "dp",
                      model: Model = "paper", time_limit: float | None = None
                      ) -> tuple[float, tuple[int, ...], tuple[int, ...]]:
    """``(latency, sigma, T)`` minimising :func:`latency` over all hierarchies ending with
    the target and all ``T`` in ``1..t_max``; ``sigma == (K,)`` (``T == ()``) is the
    target alone. The returned latency equals ``latency(costs, alpha, sigma, T, model=model)``.

    ``method``: ``"dp"`` (default, ``O(K^2 t_max^2)``) and ``"lp"`` (generalized shortest
    path LP, HiGHS; ``time_limit`` seconds, ``RuntimeError`` if not solved) optimise
    ``model="paper"``; ``"brute"`` enumerates every hierarchy (either model; ``ValueError``
    beyond ``MAX_BRUTE`` of them). Ties are broken arbitrarily but deterministically."""
    c, a = check_instance(costs, alpha, t_max)
    overshoot = _overshoot(model)
    if method == "dp" and not overshoot:
        lat, s, t = _solve_dp(c, a, int(t_max))
    elif method == "lp" and not overshoot:
        lat, s, t = _solve_lp(c, a, int(t_max), time_limit)
    elif method == "brute":
        lat, s, t = _solve_brute(c, a, int(t_max), overshoot)
    else:
        raise ValueError(f"method {method!r} with model {model!r}: use 'dp'/'lp'/'brute' "
                         "for 'paper', 'brute' for 'exact'")
    return lat, s, t


def _decode(K: int, path: list[tuple[int, int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``[(model, T), ...]`` listed from the top draft down -> ``(sigma, T)`` cheapest first."""
    path = path[::-1]
    return tuple(j for j, _ in path) + (K,), tuple(int(t) for _, t in path)


def _solve_dp(c: np.ndarray, a: np.ndarray, t: int
              ) -> tuple[float, tuple[int, ...], tuple[int, ...]]:
    """Bellman recursion. ``fill[j, T-1]`` = least expected cost for the level above ``j`` to
    collect ``>= T`` tokens from ``j``: ``T c_j`` if ``j`` is the bottom, else
    ``min_{i<j, t'} gamma(a_ij, t', T) (c_j + fill[i, t'-1])``. The latency is increasing
    in ``fill``, so the minimum of ``(c_K + fill[j, T-1]) / E(a_jK, T)`` is the optimum."""
    K = c.size - 1
    if K == 0:
        return float(c[0]), (0,), ()
    G, tv = gamma_table(a, t), np.arange(1, t + 1)
    fill, back = np.zeros((K, t)), np.full((K, t, 2), -1)
    for j in range(K):
        fill[j] = tv * c[j]
        if j == 0:
            continue
        cand = (G[:j, j] * (c[j] + fill[:j, :, None])).reshape(j * t, t)
        arg = np.argmin(cand, axis=0)
        best = cand[arg, np.arange(t)]
        better = best < fill[j]
        fill[j] = np.where(better, best, fill[j])
        back[j, better] = np.stack(np.divmod(arg[better], t), axis=-1)
    top = (c[K] + fill) / expected_tokens(a[:K, K][:, None], tv[None, :])
    j, ti = np.unravel_index(np.argmin(top), top.shape)
    if top[j, ti] >= c[K]:
        return float(c[K]), (K,), ()
    path = [(int(j), int(ti) + 1)]
    while back[j, ti, 0] >= 0:
        j, ti = back[j, ti]
        path.append((int(j), int(ti) + 1))
    return (float(top.min()),) + _decode(K, path)


def _gsp_arcs(c: np.ndarray, a: np.ndarray, t: int) -> dict[str, np.ndarray]:
    """Generalized-shortest-path graph (our reconstruction of Section 3.3). Rows: 0 = the
    source (the target), ``1 + j t + T-1`` = node ``(j, T)`` (level ``j`` filling a buffer of
    ``T`` for the level above), ``-1`` = sink. Arcs (cost per unit entering, multiplier on
    what leaves): source->sink ``c_K`` (target alone); source->(j,T) ``c_K/E(a_jK,T)``, ``1/E``;
    (j,T)->(i,t') ``g c_j``, ``g = gamma(a_ij, t', T)``; (j,T)->sink ``T c_j``. A unit path
    source->...->sink costs exactly the paper latency of the hierarchy it spells."""
    K, G, tv = c.size - 1, gamma_table(a, t), np.arange(1, t + 1)
    node = lambda j, T: 1 + j * t + T - 1  # noqa: E731
    e = expected_tokens(a[:K, K][:, None], tv[None, :])               # (K, t)
    jj, TT = np.meshgrid(np.arange(K), tv, indexing="ij")
    i, j = np.triu_indices(K, 1)
    I, J = np.repeat(i, t * t), np.repeat(j, t * t)
    T1, T2 = np.tile(np.repeat(tv, t), i.size), np.tile(tv, t * i.size)
    g = G[I, J, T1 - 1, T2 - 1]
    tail = np.concatenate([[0], np.zeros(K * t, int), node(J, T2), node(jj, TT).ravel()])
    head = np.concatenate([[-1], node(jj, TT).ravel(), node(I, T1), np.full(K * t, -1)])
    gain = np.concatenate([[0.0], 1 / e.ravel(), g, np.zeros(K * t)])
    cost = np.concatenate([[c[K]], c[K] / e.ravel(), g * c[J], (TT * c[:K, None]).ravel()])
    return dict(tail=tail, head=head, gain=gain, cost=cost, rows=1 + K * t)


def _solve_lp(c: np.ndarray, a: np.ndarray, t: int, time_limit: float | None
              ) -> tuple[float, tuple[int, ...], tuple[int, ...]]:
    """The GSP as a generalized-flow LP: one unit leaves the source, every node sends on
    what its in-arcs deliver (times their multipliers), minimise cost. The graph is acyclic
    and costs non-negative, so an optimal vertex is a single path; decoded greedily."""
    from specjax._optional import require

    sparse = require("scipy.sparse", "the HSD LP solver (method='lp')")
    linprog = require("scipy.optimize", "the HSD LP solver (method='lp')").linprog

    K = c.size - 1
    if K == 0:
        return float(c[0]), (0,), ()
    g = _gsp_arcs(c, a, t)
    n, inner = g["cost"].size, g["head"] >= 0
    rows = np.concatenate([g["tail"], g["head"][inner]])
    cols = np.concatenate([np.arange(n), np.flatnonzero(inner)])
    vals = np.concatenate([np.ones(n), -g["gain"][inner]])
    A = sparse.csr_matrix((vals, (rows, cols)), shape=(g["rows"], n))
    b = np.zeros(g["rows"])
    b[0] = 1.0
    opts = {} if time_limit is None else {"time_limit": float(time_limit)}
    res = linprog(g["cost"], A_eq=A, b_eq=b, bounds=(0, None), method="highs", options=opts)
    if res.status != 0:
        raise RuntimeError(f"LP not solved: {res.message}")
    row, path = 0, []
    while True:
        out = np.flatnonzero(g["tail"] == row)
        row = int(g["head"][out[np.argmax(res.x[out])]])
        if row < 0:
            break
        path.append(divmod(row - 1, t))
    s, T = _decode(K, [(j, ti + 1) for j, ti in path])
    lat = _value(c, a, s, T, False)
    if not math.isclose(lat, res.fun, rel_tol=1e-6):
        raise RuntimeError(f"LP value {res.fun} but decoded path has latency {lat}")
    return lat, s, T


_Best = tuple[float, tuple[int, ...], tuple[int, ...]]
_CHUNK = 4_000_000  # floats per buffer-survival block in brute force


def _solve_brute(c: np.ndarray, a: np.ndarray, t: int, overshoot: bool) -> _Best:
    """Every hierarchy, ``(1 + t)^K`` of them: prefixes sharing their lower levels are
    evaluated together (numpy), level by level, with the same recursion as :func:`latency`."""
    K = c.size - 1
    if (1 + t) ** K > MAX_BRUTE:
        raise ValueError(f"brute force over (1 + t_max)^K = {(1 + t) ** K} hierarchies "
                         f"exceeds MAX_BRUTE = {MAX_BRUTE}; use method='dp'")
    best: _Best = (float(c[K]), (K,), ())
    for bottom in range(K):
        ec, surv = _bottom(c[bottom])
        best = _brute_from(c, a, t, overshoot, (bottom,), ec, surv, np.zeros((1, 0), int), best)
    return best


def _brute_from(c: np.ndarray, a: np.ndarray, t: int, overshoot: bool, sigma: tuple[int, ...],
                ec: np.ndarray, surv: np.ndarray, Ts: np.ndarray, best: _Best) -> _Best:
    """Prefixes ``sigma`` (all with the same models; ``Ts[n]`` their thresholds, ``ec[n]``
    their call cost, ``surv[n]`` their returns): finish with the target or add a level."""
    step = max(1, _CHUNK // (t * (t + surv.shape[1])))
    if ec.size > step:
        for k in range(0, ec.size, step):
            sl = slice(k, k + step)
            best = _brute_from(c, a, t, overshoot, sigma, ec[sl], surv[sl], Ts[sl], best)
        return best
    K, j, tv = c.size - 1, sigma[-1], np.arange(1, t + 1)
    calls, surv_b = _level_up(ec, surv, t, overshoot)
    fill = calls * ec[:, None]                                         # (n, t)
    lat = (c[K] + fill) / np.sum(_returned_surv(a[j, K], surv_b)[..., 1:], axis=-1)
    n, ti = np.unravel_index(np.argmin(lat), lat.shape)
    if lat[n, ti] < best[0]:
        best = (float(lat[n, ti]), sigma + (K,), tuple(int(x) for x in Ts[n]) + (int(tv[ti]),))
    Ts2 = np.concatenate([np.repeat(Ts, t, axis=0), np.tile(tv, ec.size)[:, None]], axis=1)
    for nxt in range(j + 1, K):
        surv2 = _returned_surv(a[j, nxt], surv_b).reshape(ec.size * t, -1)
        best = _brute_from(c, a, t, overshoot, sigma + (nxt,), (c[nxt] + fill).ravel(),
                           surv2, Ts2, best)
    return best
