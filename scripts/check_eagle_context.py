"""Shows, against SafeAILab/EAGLE's own code (unmodified) and optionally SpecForge's, that a
head in EAGLE's published layout drafts the same logits in specjax as in EAGLE's ``ea_layer``
on a real prompt of SmolLM2-135M-Instruct: at every position, for the first draft step and
for the draft steps after it. Run out of CI, by hand; no test imports it.

What it compares, per head (a random EAGLE-3 head and a random EAGLE-1/2 head in the
published layouts, ``tests/published.py``; or any published head directory, ``--head``):

* The target's hidden states are computed once, by specjax, in float32 (the last layer's
  final-normed output for EAGLE-1/2; the streams entering layers 2, L/2 and L-3 for EAGLE-3,
  which are the layers EAGLE's ``modeling_llama_kv.py`` collects), and the same arrays go to
  both sides, so the comparison isolates the draft layer and the draft context.
* For every prefix ``p = 1..N`` of the prompt (root token: the prompt's token ``p``, and
  after the prompt the target's greedy token), specjax's drafter as users build it
  (``methods.build(spec, lm, Options(draft_checkpoint=DIR))``) runs its own ``init`` and
  ``propose``; its ``_logq`` is wrapped to record the logits each step drafts from. EAGLE's
  ``ea_layer`` (``cnets.Model`` for EAGLE-3, ``cnets1.Model`` for EAGLE-1/2, built from
  ``config.json`` and the state dict as ``EaModel`` builds it, embedding from the target)
  runs ``topK_genrate`` on the same prefix, incrementally through its ``stable_kv`` as
  ``EaModel.eagenerate`` does; a forward hook on its LM head records the logits of each of
  its steps. Step 0 is the root's distribution (every position of the prompt, once each);
  step ``s >= 1`` are the ``top_k`` nodes expanded at tree level ``s``. Also compared: the
  drafted tree (tokens and parents) per prefix, for EAGLE's default tree (``EaModel``:
  depth 7, top_k 10, total_token 60; specjax ``eagle3:8,10,59``) and the 6-node tree of the
  acceptance targets (``eagle2:3,4,6``; EAGLE depth 2, top_k 4, total_token 7).
* A top-1 chain of ``CHAIN`` steps (the head fed its own output, the token EAGLE's top-1),
  through EAGLE's ``forward`` with a KV cache at positions ``root + s``, and through specjax's
  head (``drafter._head``) in the new layout and in the OLD one (a leading entry of token 0
  with a zero feature, every entry one position later), to show that the difference the
  new layout removes is real.
* With ``--only specforge`` (transformers 5, SpecForge's tree on ``sys.path``): SpecForge's
  ``LlamaForCausalLMEagle3`` forward over the same context as its trainer builds it
  (``input_ids`` shifted by one beside the hidden states, ``target_head.py``), at every
  position, against specjax's root logits (EAGLE-3 heads only).

Set-up (EAGLE pins transformers 4; specjax's venv has transformers 5, so EAGLE's side runs
with a transformers 4.53.3 shadowing it on PYTHONPATH; torch is the venv's)::

    git -C EAGLE_MIRROR archive -o /tmp/eagle.tar HEAD eagle   # SafeAILab/EAGLE @ cb7e084
    mkdir -p /tmp/eagle-src && tar -x -C /tmp/eagle-src -f /tmp/eagle.tar
    .venv/bin/pip install --target /tmp/tf4 --no-deps "transformers==4.53.3" \\
        "tokenizers>=0.21,<0.22" "huggingface_hub>=0.30,<1.0"
    PYTHONPATH=/tmp/tf4 .venv/bin/python scripts/check_eagle_context.py \\
        --eagle /tmp/eagle-src --out docs/results/eagle_context

    # SpecForge (sgl-project/SpecForge @ a6b6b02, its specforge/ package as is), under the
    # venv's transformers 5:
    git -C SPECFORGE_MIRROR archive -o /tmp/sf.tar HEAD specforge
    mkdir -p /tmp/specforge-src && tar -x -C /tmp/specforge-src -f /tmp/sf.tar
    .venv/bin/python scripts/check_eagle_context.py --only specforge \\
        --specforge /tmp/specforge-src --out docs/results/eagle_context

Writes ``OUT/eagle.json`` (or ``OUT/specforge.json``) and prints one line per comparison.
Exits 1 if a new-layout logit differs by more than ``TOL`` (1e-4) or a drafted tree differs.
A drafted tree that differs only where EAGLE chose between candidates tied to within 1e-5
in path value (an exact float32 tie between two sibling leaves included: which one a tree
keeps is up to each code's tie-breaking) is classified ``tie_broken`` (``classify_tree``)
and reported apart, on its own line and in ``trees_tie_broken``, as the steps after a tie
are (``tie_broken_steps``); it does not fail the check.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from specjax.jax_setup import setup_jax  # noqa: E402

setup_jax()  # as the specjax commands run: XLA:CPU's in-place flag, the compilation cache

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-4
CHAIN = 3
CHUNK = 16
# A Spec-Bench-style question (writing), in SmolLM2's chat template.
PROMPT = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting "
          "cultural experiences and must-see attractions.")
# (EAGLE depth, top_k, total_token) -> specjax (depth + 1, top_k, total_token - 1)
TREES = {"eaglemodel-default": (7, 10, 60), "acceptance-6-node": (2, 4, 7)}
EAGLE1_SCALE = {"fc": 0.4, "o_proj": 0.3, "down_proj": 0.3}  # by module name
SMOL = dict(hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152)


# ----------------------------------------------------------------------------- the target

def load_target():
    import specjax.models

    return specjax.models.load("smollm2-135m")  # float32 weights and compute


def prompt_ids(lm) -> list[int]:
    """The prompt's ids in SmolLM2's chat template."""
    return lm.encode(PROMPT, chat=True)


def capacity(n: int) -> int:
    """Slots of the token buffer: a whole number of chunks with a chunk to spare past the
    root, as decoding allocates (a chunk read past the buffer's end would be clamped)."""
    return (n // CHUNK + 2) * CHUNK


def prefill(lm, tokens: list[int], cap: int, layers):
    """specjax's prefill of ``tokens``: the hidden states at every slot (``layers``) and the
    target's greedy next token."""
    import jax
    import jax.numpy as jnp

    from specjax.core.decoding import prefill as _prefill

    model, params = lm.model, lm.params
    buf = jnp.zeros((1, cap), jnp.int32).at[0, :len(tokens)].set(jnp.asarray(tokens))

    @jax.jit
    def run(params, buf, p):
        h_last, _, h_all = _prefill(model, params, buf, p, model.init_cache(1, cap), CHUNK,
                                    layers)
        return jnp.argmax(model.logits(params, h_last), -1), h_all

    first, hidden = run(params, buf, jnp.asarray([len(tokens)]))
    return int(first[0]), hidden


# ----------------------------------------------------------------------------- heads

def write_heads(root: Path) -> dict[str, Path]:
    """Random heads in EAGLE's published layouts, sized for SmolLM2-135M (its RoPE base and
    eps), bfloat16 as published: EAGLE-3 with an 8192-token draft vocabulary, EAGLE-1/2 in
    the LLaMA-3 style (no fc bias)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch

    from published import edit_state_dict, write_eagle1_head, write_eagle3_head

    out = {"random-eagle3": root / "eagle3", "random-eagle1": root / "eagle1"}
    write_eagle3_head(out["random-eagle3"], **SMOL, draft_vocab=8192,
                                rope_theta=100000.0, weights="model.safetensors",
                                dtype=torch.bfloat16, seed=1)
    write_eagle1_head(out["random-eagle1"], **SMOL, style="llama3", rope_theta=100000.0,
                      weights="pytorch_model.bin", dtype=torch.bfloat16, seed=2)

    def contract(sd):  # random weights grow the feature ~2x per draft step (logits in the
        for k in sd:   # thousands by step 7); scaled, it keeps the scale a trained head keeps
            f = EAGLE1_SCALE.get(k.split(".")[-2] if k.count(".") else k, 1.0)
            if sd[k].is_floating_point() and f != 1.0:
                sd[k] = (sd[k].float() * f).to(torch.bfloat16)

    edit_state_dict(out["random-eagle1"], contract)
    return out


def head_kind(head_dir: Path) -> str:
    cfg = json.loads((head_dir / "config.json").read_text())
    return "eagle3" if "draft_vocab_size" in cfg else "eagle"


def specjax_drafter(lm, head_dir: Path, sizes: tuple[int, int, int]):
    """The drafter and its params as users build them, at specjax's sizes."""
    from specjax import methods

    kind = "eagle3" if head_kind(head_dir) == "eagle3" else "eagle2"
    built = methods.build(f"{kind}:{sizes[0]},{sizes[1]},{sizes[2]}", lm,
                          methods.Options(draft_checkpoint=str(head_dir)))
    return built.decoder.drafter, built.params[1]


def draft_logits(drafter, dparams, tparams, f):
    """The logits ``drafter._logq`` normalizes (over its draft vocabulary)."""
    from specjax.drafters import blocks, eagle3

    if isinstance(drafter, eagle3.Eagle3Drafter):
        return eagle3.draft_logits(drafter.layer_spec, dparams["head"], f)
    return blocks.head_logits(drafter._embed(dparams, tparams).astype(f.dtype), f)


def recording_runner(drafter):
    """A jitted ``init`` then ``propose`` of ``drafter`` on a Context, returning the draft's
    tokens and parents and the logits of every ``_logq`` call (the root's ``[1, V]``, then
    each level's ``[1, K, V]``), recorded while ``propose`` traces."""
    import jax

    from specjax.core import sampling

    rec: list = []
    cls = type(drafter)

    class Recording(cls):
        def _logq(self, dp, tp, f):
            rec.append(draft_logits(self, dp, tp, f))
            return cls._logq(self, dp, tp, f)

    rd = Recording(**{f.name: getattr(drafter, f.name) for f in dataclasses.fields(drafter)})

    @jax.jit
    def run(dp, ctx):
        rec.clear()
        state = rd.init(dp, ctx, CHUNK)
        draft, _, _ = rd.propose(dp, state, ctx, jax.random.key(0), sampling.Greedy())
        return draft.tokens, draft.parents, list(rec)

    return run


def chain_runner(drafter):
    """specjax's head over a whole context of head entries (causal, positions = entry
    index), then ``CHAIN`` single steps from entry ``r`` fed its own output, at positions
    ``r + s``, with the given tokens: the logits of steps 0..CHAIN and of every entry."""
    import jax
    import jax.numpy as jnp

    from specjax.drafters import blocks, eagle

    spec = drafter.layer_spec

    @jax.jit
    def run(dp, tp, toks, feats, r, chain_toks):
        b, n = toks.shape
        layers = eagle.num_layers(dp["head"])
        k, v = blocks.empty_kv(spec, b, n + CHAIN + 1, jnp.float32, layers)
        pos = jnp.arange(n)[None]
        out, k, v = drafter._head(dp, tp, toks, feats, pos, k, v, jnp.zeros((b,), jnp.int32),
                                  blocks.causal(b, n))
        every = draft_logits(drafter, dp, tp, out)[0]
        f = lax_row(out, r)
        steps = [draft_logits(drafter, dp, tp, f)[0, 0]]
        for s in range(1, CHAIN + 1):
            f, k, v = drafter._head(dp, tp, chain_toks[s - 1][None, None], f,
                                    jnp.full((b, 1), r + s), k, v, jnp.full((b,), r + s),
                                    blocks.causal(b, 1))
            steps.append(draft_logits(drafter, dp, tp, f)[0, 0])
        return every, jnp.stack(steps)

    return run


def lax_row(x, r):
    import jax

    return jax.lax.dynamic_slice_in_dim(x, r, 1, axis=1)


# ----------------------------------------------------------------------------- EAGLE's side

def eagle_layer(eagle_dir: Path, head_dir: Path, embed: np.ndarray, tree: tuple[int, int, int]):
    """EAGLE's ``ea_layer`` as ``EaModel.__init__``/``from_pretrained`` build it: the config
    read by ``EConfig``, ``bias`` from config.json, the state dict loaded ``strict=False``
    (``d2t``/``t2d`` dropped for a full-size draft vocabulary), the target's embedding (the
    rows ``load_emb`` would read), float32, ``init_tree``."""
    if str(eagle_dir) not in sys.path:
        sys.path.insert(0, str(eagle_dir))
    import torch
    from safetensors.torch import load_file

    from eagle.model.cnets import Model as Model3
    from eagle.model.cnets1 import Model as Model1
    from eagle.model.configs import EConfig

    depth, top_k, total = tree
    cfg_path = head_dir / "config.json"
    config = EConfig.from_pretrained(str(cfg_path))
    bias = json.loads(cfg_path.read_text()).get("bias", True)
    eagle3 = head_kind(head_dir) == "eagle3"
    cls = Model3 if eagle3 else Model1
    m = cls(config, bias=bias, total_tokens=total, depth=depth, top_k=top_k, threshold=1.0)
    if eagle3 and config.vocab_size == config.draft_vocab_size:
        del m.d2t, m.t2d
    f = head_dir / "pytorch_model.bin"
    sd = torch.load(f, map_location="cpu") if f.is_file() else load_file(
        str(head_dir / "model.safetensors"))
    missing, unexpected = m.load_state_dict(sd, strict=False)
    m.embed_tokens.weight.data = torch.from_numpy(np.asarray(embed, np.float32)).clone()
    m = m.float().eval()
    m.init_tree()
    return m, {"missing": sorted(missing), "unexpected": sorted(unexpected)}


class Hook:
    """Records the outputs of a module (EAGLE's LM head) call by call."""

    def __init__(self, module):
        self.calls: list[np.ndarray] = []
        module.register_forward_hook(lambda _m, _i, o: self.calls.append(o.detach().numpy()))


def tree_parents(tree_mask: np.ndarray) -> np.ndarray:
    """Each node's parent among the nodes (-1: the root) from EAGLE's ``[1,1,T+1,T+1]`` tree
    mask (row ``i + 1``: node ``i``'s ancestors and itself; column 0: the root)."""
    m = tree_mask[0, 0] > 0
    out = []
    for i in range(1, m.shape[0]):
        anc = [j for j in range(i) if m[i, j]]
        out.append(max(anc) - 1)
    return np.asarray(out)


def tie_steps(calls: list[np.ndarray], top_k: int, eps: float = 1e-5) -> int:
    """The last tree step whose expanded nodes are decided without a tie: replays EAGLE's
    choice from its recorded logits (``calls``: the root's, then each step's), and returns
    ``s`` when the ``top_k``-th and next-best path values of level ``s + 1`` lie within
    ``eps`` (float32 rounding then decides which node step ``s + 1`` expands, and the two
    codes may break the tie differently), else the number of steps."""
    lsm = lambda x: x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - x.max(-1, keepdims=True)  # noqa: E731
    root = np.sort(lsm(calls[0].astype(np.float64))[0])[::-1]
    if root[top_k - 1] - root[top_k] < eps:
        return 0
    scores = root[:top_k]
    for s in range(1, len(calls)):
        lp = np.sort(lsm(calls[s].astype(np.float64)), -1)[:, ::-1][:, :top_k]
        cu = np.sort((lp + scores[:, None]).ravel())[::-1]
        if s < len(calls) - 1 and cu[top_k - 1] - cu[top_k] < eps:
            return s
        scores = cu[:top_k]
    return len(calls) - 1


def selection_ties(calls: list[np.ndarray], top_k: int, total_tokens: int,
                   eps: float = 1e-5) -> list[str]:
    """Where EAGLE's ``topK_genrate`` chose between candidates whose values lie within
    ``eps`` (``tie_steps``' rule; an exact float32 tie, gap 0, is one), replayed from its
    recorded logits (``calls``: the root's ``[1, V]``, then each step's ``[top_k, V]``):
    the root's top ``top_k``, each expanded node's top ``top_k`` children, each level's
    ``top_k`` nodes to expand, and the ``total_tokens`` nodes the tree keeps. Only a tie
    whose value reaches the lowest kept node's (less ``eps``) is named: a path's value never
    grows along it, so below that no choice changes the drafted tree. Two codes may break
    such a tie differently (``torch.topk`` against specjax's ordering), so trees that differ
    where one was decided are tie-broken, not wrong (``classify_tree``)."""
    lsm = lambda x: x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - x.max(-1, keepdims=True)  # noqa: E731
    found: list[tuple[str, float, float]] = []

    def near(desc: np.ndarray, k: int, what: str) -> None:
        if len(desc) > k and desc[k - 1] - desc[k] < eps:
            found.append((what, float(desc[k - 1]), float(desc[k])))

    root = np.sort(lsm(np.asarray(calls[0], np.float64))[0])[::-1]
    near(root, top_k, "the root's top-k")
    scores = root[:top_k]
    values = [scores]
    for s in range(1, len(calls)):
        lp = np.sort(lsm(np.asarray(calls[s], np.float64)), -1)[:, ::-1]
        for j, row in enumerate(lp):
            if len(row) > top_k and row[top_k - 1] - row[top_k] < eps:
                found.append((f"step {s}: node {j}'s top-k children",
                              float(scores[j] + row[top_k - 1]), float(scores[j] + row[top_k])))
        cu = (lp[:, :top_k] + scores[:, None]).ravel()
        values.append(cu)
        desc = np.sort(cu)[::-1]
        if s < len(calls) - 1:  # the last level expands nothing further
            near(desc, top_k, f"step {s}: the nodes expanded")
        scores = desc[:top_k]
    kept = np.sort(np.concatenate(values))[::-1]
    near(kept, total_tokens, "the tree's kept nodes")
    floor = kept[min(total_tokens, len(kept)) - 1] - eps
    return [f"{what} ({a:.9g} and {b:.9g})" for what, a, b in found if a >= floor]


TREE_KINDS = ("equal", "tie_broken", "differ")


def classify_tree(same: bool, ties: list[str]) -> str:
    """A drafted tree against EAGLE's: ``equal``; ``tie_broken`` where they differ and
    EAGLE's choices met a tie that can change the tree (``selection_ties``), as near ties
    are reported apart from mismatches elsewhere (``specjax.divergence``); else
    ``differ``, a real difference (the check fails)."""
    if same:
        return "equal"
    return "tie_broken" if ties else "differ"


def matched_rows(ours: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    """EAGLE's rows in specjax's row order: the nodes a level expands are ranked by path
    value, and two whose values tie to float32 rounding may come in either order; each of
    specjax's rows is paired with EAGLE's nearest row (the identity unless such a swap)."""
    d = np.abs(ours[:, None, :].astype(np.float64) - theirs[None, :, :]).max(-1)
    match = d.argmin(1)
    return theirs[match] if len(set(match.tolist())) == len(match) else theirs


# ----------------------------------------------------------------------------- the run

class Stats:
    """Running max |diff| and top-1 agreement per step."""

    def __init__(self):
        self.d: dict = {}

    def add(self, key, ours, theirs):
        ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
        ours = ours.reshape(-1, ours.shape[-1])
        theirs = theirs.reshape(-1, theirs.shape[-1])
        e = self.d.setdefault(key, {"max_abs_logit_diff": 0.0, "max_abs_logprob_diff": 0.0,
                                    "rows": 0, "top1_agree": 0, "logit_scale": 0.0})
        lp = lambda x: x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - x.max(-1, keepdims=True)  # noqa: E731
        e["max_abs_logit_diff"] = max(e["max_abs_logit_diff"], float(np.abs(ours - theirs).max()))
        e["max_abs_logprob_diff"] = max(e["max_abs_logprob_diff"],
                                        float(np.abs(lp(ours) - lp(theirs)).max()))
        e["rows"] += ours.shape[0]
        e["top1_agree"] += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        e["logit_scale"] = max(e["logit_scale"], float(np.abs(theirs).max()))

    def out(self):
        return {k: {**v, "top1_agreement": v["top1_agree"] / max(v["rows"], 1)}
                for k, v in self.d.items()}


def layouts(seq: list[int], feats, n: int):
    """``(toks_new, feats_new, toks_old, feats_old)``: the head's entries over ``seq`` in
    EAGLE's layout (entry t: token t+1, feature t) and in specjax's old one (entry 0: token
    0 beside a zero feature; entry t: token t, feature t-1)."""
    import jax.numpy as jnp

    toks_new, feats_new = jnp.asarray([seq[1:] + [0]]), feats[:, :n + 1]
    toks_old = jnp.asarray([seq])
    feats_old = jnp.concatenate([jnp.zeros_like(feats[:, :1]), feats[:, :n]], axis=1)
    return toks_new, feats_new, toks_old, feats_old


def prefix_context(seq: list[int], p: int, cap: int, cache, tparams, hidden):
    """The drafter's ``Context`` over the prefix ``seq[:p + 1]`` (prompt ``p`` tokens, the
    root ``seq[p]``) in a ``cap``-slot buffer."""
    import jax.numpy as jnp

    from specjax.drafters import Context

    buf = np.zeros((1, cap), np.int32)
    buf[0, :p + 1] = seq[:p + 1]
    return Context(tokens=jnp.asarray(buf), length=jnp.asarray([p + 1]),
                   prompt_len=jnp.asarray([p]), cache=cache, params=tparams, hidden=hidden)


def run_eagle(args, lm, heads) -> dict:
    import jax.numpy as jnp
    import torch

    from specjax.drafters import eagle as eagle_mod

    prompt = prompt_ids(lm)
    n = len(prompt)
    cap = capacity(n)
    tparams = lm.params
    embed = np.asarray(lm.model.embed(tparams, jnp.arange(lm.model.config.vocab_size)[None])[0])
    out_embed = np.asarray(eagle_mod.output_embedding(lm.model, tparams))
    report = {"prompt": PROMPT, "prompt_tokens": n, "prompt_ids": prompt, "heads": {}}
    ps = list(range(1, n + 1))[-args.prefixes:]  # the prefixes checked (0: all)
    worst, tree_bad, tree_tied = 0.0, 0, 0
    for name, head_dir in heads.items():
        kind = head_kind(head_dir)
        hrep = report["heads"][name] = {"kind": kind, "dir": head_dir.name, "trees": {}}
        for tname, tree in TREES.items():
            depth, top_k, total = tree
            sizes = (depth + 1, top_k, total - 1)
            drafter, dparams = specjax_drafter(lm, head_dir, sizes)
            first, hidden = prefill(lm, prompt, cap, drafter.feature_layers)
            seq = prompt + [first]  # the root after the prompt: the target's greedy token
            feats = drafter._features(tparams, hidden)  # what the head reads: [1, cap, F]
            feats_np = np.asarray(feats, np.float32)
            m, load = eagle_layer(args.eagle, head_dir, embed, tree)
            head_t = None
            if kind == "eagle":  # EAGLE-1/2 drafts through the target's LM head
                head_t = torch.nn.Linear(out_embed.shape[1], out_embed.shape[0], bias=False)
                head_t.weight.data = torch.from_numpy(out_embed).clone()
            hook = Hook(m.lm_head if kind == "eagle3" else head_t)
            d2t = (m.d2t.numpy() if hasattr(m, "d2t") and kind == "eagle3" else None)
            to_target = (lambda d: d + d2t[d]) if d2t is not None else (lambda d: d)
            run = recording_runner(drafter)
            chain = chain_runner(drafter)
            stats, trees_equal, ties, t0 = Stats(), 0, [], time.time()
            tree_ties: list = []  # prefixes whose trees differ only where a tie decided
            cache = lm.model.init_cache(1, cap)
            H = torch.from_numpy(feats_np[:, :n])
            ids = torch.tensor([seq])
            # EAGLE's whole-prompt forward (what its first topK_genrate runs): every position
            with torch.no_grad():
                m.reset()
                full, _ = m(H, input_ids=ids[:, 1:n + 1], use_cache=True)
                full_logits = (m.lm_head(m.norm(full)) if kind == "eagle3" else head_t(full))
            hook.calls.clear()
            full_logits = full_logits[0].numpy()
            m.reset_kv()
            # the old layout's entries (token 0 with a zero feature first) and the new ones
            toks_new, feats_new, toks_old, feats_old = layouts(seq, feats, n)
            for p in ps:
                # specjax: the drafter's own init + propose on the prefix
                ctx = prefix_context(seq, p, cap, cache, tparams, hidden)
                d_tok, d_par, rec = run(dparams, ctx)
                # EAGLE: topK_genrate on the same prefix, incrementally (stable_kv)
                kv_len = 0 if getattr(m, "stable_kv", None) is None else \
                    m.stable_kv[0][0].shape[2]
                hook.calls.clear()
                with torch.no_grad():
                    e_tok, _, e_mask, e_pos = m.topK_genrate(H[:, kv_len:p], ids[:, :p + 1],
                                                             head_t, None)
                calls = list(hook.calls)
                stats.add("step0_root_vs_topK_genrate", rec[0], calls[0])
                stats.add("step0_root_vs_whole_prompt_forward", rec[0], full_logits[p - 1])
                tied = tie_steps(calls, top_k)
                for s in range(1, depth + 1):
                    ours, theirs = np.asarray(rec[s])[0], calls[s]
                    if s > tied:  # nodes expanded after a tie in path value: tie-broken
                        ties.append({"prefix": p, "step": s, "raw_max_abs_logit_diff":
                                     float(np.abs(ours - theirs).max())})
                        continue
                    stats.add(f"tree_step{s}", ours, matched_rows(ours, theirs))
                same = (np.array_equal(np.asarray(d_tok[0]), e_tok[0, 1:].numpy())
                        and np.array_equal(np.asarray(d_par[0]), tree_parents(e_mask.numpy())))
                decided = [] if same else selection_ties(calls, top_k, total - 1)
                verdict = classify_tree(same, decided)
                trees_equal += int(verdict == "equal")
                if verdict == "tie_broken":
                    tree_ties.append({"prefix": p, "ties": decided})
                if tname != "eaglemodel-default":
                    continue
                # top-1 chains: EAGLE's forward with a KV cache, specjax new and old layouts
                with torch.no_grad():
                    m.reset()
                    o, kv = m(H[:, :p], input_ids=ids[:, 1:p + 1], use_cache=True)
                    f = o[:, -1:]
                    lg = [(m.lm_head(m.norm(f)) if kind == "eagle3" else head_t(f))[0, 0]]
                    ctoks = []
                    for s in range(1, CHAIN + 1):
                        c = int(to_target(int(lg[-1].argmax())))
                        ctoks.append(c)
                        f, kv = m(f, input_ids=torch.tensor([[c]]), past_key_values=kv,
                                  position_ids=torch.tensor([p - 1 + s]), use_cache=True)
                        lg.append((m.lm_head(m.norm(f)) if kind == "eagle3" else head_t(f))[0, 0])
                e_chain = torch.stack(lg).numpy()
                ct = jnp.asarray(ctoks, jnp.int32)
                _, new = chain(dparams, tparams, toks_new, feats_new, p - 1, ct)
                _, old = chain(dparams, tparams, toks_old, feats_old, p, ct)
                for s in range(CHAIN + 1):
                    stats.add(f"chain_step{s}_new_layout", new[s], e_chain[s])
                    stats.add(f"chain_step{s}_old_layout", old[s], e_chain[s])
            m.reset_kv()
            res = stats.out()
            hrep["trees"][tname] = {
                "eagle": {"depth": depth, "top_k": top_k, "total_token": total},
                "specjax_spec": f"{'eagle3' if kind == 'eagle3' else 'eagle2'}:"
                                f"{sizes[0]},{sizes[1]},{sizes[2]}",
                "eagle_load_state_dict": load,
                "prefixes": len(ps), "trees_equal": trees_equal,
                "trees_tie_broken": tree_ties,
                "trees_differing": len(ps) - trees_equal - len(tree_ties),
                "tie_broken_steps": ties,
                "seconds": round(time.time() - t0, 1), "compare": res}
            for key, v in res.items():
                print(f"{name} {tname} {key}: max|logit diff| {v['max_abs_logit_diff']:.3g} "
                      f"(logits up to {v['logit_scale']:.3g}), max|logprob diff| "
                      f"{v['max_abs_logprob_diff']:.3g}, top-1 {v['top1_agreement']:.4f} "
                      f"of {v['rows']}", flush=True)
                if "old_layout" not in key:
                    worst = max(worst, v["max_abs_logit_diff"])
            print(f"{name} {tname}: drafted trees equal at {trees_equal}/{len(ps)} prefixes; "
                  f"{len(ties)} tree steps after a tie in path value left out: {ties}",
                  flush=True)
            print(f"{name} {tname}: drafted trees differing only where a tie in path value "
                  f"decided (float32 rounding; not counted as differing): {len(tree_ties)}/"
                  f"{len(ps)} prefixes {tree_ties}", flush=True)
            tree_bad += len(ps) - trees_equal - len(tree_ties)
            tree_tied += len(tree_ties)
    report["worst_new_layout_logit_diff"] = worst
    report["trees_differing"] = tree_bad
    report["trees_tie_broken"] = tree_tied
    report["ok"] = bool(worst <= TOL and tree_bad == 0)
    return report


def run_specforge(args, lm, heads) -> dict:
    """SpecForge's EAGLE-3 draft model over the context its trainer builds (input_ids
    shifted by one beside the hidden states, positions 0..N-1), every position, against
    specjax's root logits from the drafter's own init + propose on each prefix."""
    import jax.numpy as jnp
    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(args.specforge))
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    prompt = prompt_ids(lm)
    n, cap, tparams = len(prompt), capacity(len(prompt)), lm.params
    embed = np.asarray(lm.model.embed(tparams, jnp.arange(lm.model.config.vocab_size)[None])[0])
    report = {"prompt": PROMPT, "prompt_tokens": n, "prompt_ids": prompt, "heads": {}}
    worst = 0.0
    for name, head_dir in heads.items():
        if head_kind(head_dir) != "eagle3":
            continue
        drafter, dparams = specjax_drafter(lm, head_dir, (2, 2, 2))
        first, hidden = prefill(lm, prompt, cap, drafter.feature_layers)
        seq = prompt + [first]
        feats_np = np.asarray(drafter._features(tparams, hidden), np.float32)
        config = AutoDraftModelConfig.from_file(str(head_dir / "config.json"))
        model = AutoDraftModel.from_config(config).eval()  # float32
        missing, unexpected = model.load_state_dict(load_file(str(head_dir /
                                                                  "model.safetensors")),
                                                    strict=False)
        if "embed_tokens.weight" in missing:  # SpecForge's default: the target's embedding
            model.embed_tokens.weight.data.copy_(torch.from_numpy(embed))
        with torch.no_grad():
            ids = torch.tensor([seq[1:n + 1]])  # target_head.py: input_ids shifted by one
            h = model.project_hidden_states(torch.from_numpy(feats_np[:, :n]))
            e = model.embed_input_ids(ids).to(h.dtype)
            mask = model.prepare_decoder_attention_mask(torch.ones(1, n, dtype=torch.bool), h,
                                                        1, n, 0)
            x = model.backbone(input_embeds=e, hidden_states=h, cache_hidden=None,
                               attention_mask=mask, position_ids=torch.arange(n)[None])
            theirs = model.compute_logits(x)[0].numpy()
            # its training-time test (algorithms/eagle3/model.py, sdpa): step s feeds step
            # s-1's output beside the ids shifted s more, keys of steps >= 1 seen on the
            # diagonal only and rotated to position + s; at entry t that is the chain from
            # root t with the prompt's next tokens, at positions t + s
            cache_hidden, hcur, ttt = [[], []], h, []
            for st in range(CHAIN + 1):
                ids_s = torch.tensor([(seq[1 + st:n + 1] + [0] * st)[:n]])
                e = model.embed_input_ids(ids_s).to(h.dtype)
                hcur = model.backbone(input_embeds=e, hidden_states=hcur,
                                      cache_hidden=cache_hidden, attention_mask=mask,
                                      position_ids=torch.arange(n)[None])
                ttt.append(model.compute_logits(hcur)[0].numpy())
        run = recording_runner(drafter)
        chain = chain_runner(drafter)
        feats = drafter._features(tparams, hidden)
        toks_new, feats_new, toks_old, feats_old = layouts(seq, feats, n)
        cache = lm.model.init_cache(1, cap)
        stats = Stats()
        for p in range(1, n + 1)[-args.prefixes:]:
            ctx = prefix_context(seq, p, cap, cache, tparams, hidden)
            _, _, rec = run(dparams, ctx)
            stats.add("step0_root_vs_specforge_forward", rec[0], theirs[p - 1])
            if p + CHAIN > n:
                continue
            ct = jnp.asarray(seq[p + 1:p + 1 + CHAIN], jnp.int32)
            _, new = chain(dparams, tparams, toks_new, feats_new, p - 1, ct)
            _, old = chain(dparams, tparams, toks_old, feats_old, p, ct)
            for st in range(CHAIN + 1):
                stats.add(f"ttt_step{st}_new_layout", new[st], ttt[st][p - 1])
                stats.add(f"ttt_step{st}_old_layout", old[st], ttt[st][p - 1])
        res = stats.out()
        report["heads"][name] = {"kind": "eagle3", "dir": head_dir.name,
                                 "specforge_load_state_dict": {"missing": sorted(missing),
                                                               "unexpected": sorted(unexpected)},
                                 "compare": res}
        for key, v in res.items():
            print(f"{name} {key}: max|logit diff| {v['max_abs_logit_diff']:.3g} (logits up "
                  f"to {v['logit_scale']:.3g}), top-1 {v['top1_agreement']:.4f} of "
                  f"{v['rows']}", flush=True)
            if "old_layout" not in key:
                worst = max(worst, v["max_abs_logit_diff"])
    report["worst_new_layout_logit_diff"] = worst
    report["ok"] = bool(worst <= TOL)
    return report


def _git(*a, cwd=ROOT) -> str:
    try:
        return subprocess.run(["git", *a], cwd=cwd, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--eagle", type=Path, help="a SafeAILab/EAGLE checkout (holding eagle/)")
    ap.add_argument("--specforge", type=Path, help="a SpecForge checkout (holding specforge/)")
    ap.add_argument("--only", choices=("eagle", "specforge"), default="eagle")
    ap.add_argument("--head", type=Path, action="append", default=[],
                    help="a published head directory to check too (repeatable)")
    ap.add_argument("--no-random", action="store_true", help="skip the random heads")
    ap.add_argument("--prefixes", type=int, default=0,
                    help="check only the last K prefixes (0: every prefix)")
    ap.add_argument("--out", type=Path, default=None, help="directory for the JSON report")
    args = ap.parse_args(argv)
    import torch
    import transformers

    lm = load_target()
    with tempfile.TemporaryDirectory() as tmp:
        heads = {} if args.no_random else write_heads(Path(tmp))
        heads.update({h.name: h for h in args.head})
        if args.only == "eagle":
            if args.eagle is None:
                ap.error("--eagle DIR is needed")
            report = run_eagle(args, lm, heads)
            code = {"repo": "SafeAILab/EAGLE", "commit": _git("rev-parse", "--short", "HEAD",
                                                               cwd=args.eagle) or "cb7e084"}
        else:
            if args.specforge is None:
                ap.error("--specforge DIR is needed")
            report = run_specforge(args, lm, heads)
            code = {"repo": "sgl-project/SpecForge", "commit": "a6b6b02"}
    report.update(code=code, specjax_commit=_git("rev-parse", "--short", "HEAD"),
                  specjax_tree_dirty=bool(_git("status", "--porcelain", "specjax")),
                  transformers=transformers.__version__, torch=torch.__version__,
                  machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
                  target="smollm2-135m (GGUF, float32)", tol=TOL)
    print(f"{'OK' if report['ok'] else 'FAIL'}: worst new-layout logit diff "
          f"{report['worst_new_layout_logit_diff']:.3g}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.only}.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
