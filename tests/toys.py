"""Shared tiny models for the tests: one Llama, one Gemma (a sliding and a full layer) and
one T5, each with deterministic random parameters (built once per process and cached), and
a ``ToyLM`` standing in for ``specjax.models.LoadedModel`` where a test needs an ``lm``.

Every Llama config a test builds is ``LLAMA`` or a named variant of it below (made with
``dataclasses.replace``, each saying what needs the difference); a test that checks a
refusal may still change one field of these inline.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from specjax.models import gemma, gemma4, t5
from specjax.models.llama import Llama, LlamaConfig, RopeScaling
from specjax.models.llama import init_params as llama_init

WEIGHTS_READ = "the weights were read"  # what the weights_guard fixture raises

V = 12
# 3 layers, so an early exit at layer 1 or 2 and a 3-level hierarchy fit below the target
LLAMA = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
# variants of LLAMA, each for what needs the difference:
# 4 layers and 32 tokens: exit heads trained at layers 1-3 below the top (a 24-token KL
# vocabulary), and calibration over exits at 1 and 2 with a third level between them
LLAMA_DEEP = dataclasses.replace(LLAMA, vocab_size=32, num_layers=4,
                                 max_position_embeddings=512)
# 8 query and 4 KV heads (hidden 64), 2 layers, 64 tokens: meshes of up to 8 devices split
# the heads (tests/test_sharding), two layers keeping its 8-device compiles cheap
LLAMA_WIDE = dataclasses.replace(LLAMA, vocab_size=64, hidden_size=64, intermediate_size=128,
                                 num_layers=2, num_heads=8, num_kv_heads=4,
                                 max_position_embeddings=512)
# 2 layers: compile-heavy tests that need no exit above layer 1 (tests/test_widths compiles
# every verification width of several drafters; tests/test_decoding)
LLAMA_2 = dataclasses.replace(LLAMA, num_layers=2)
# 16 tokens, 512 positions: the training runs (EAGLE, ReDrafter) whose step counts and loss
# thresholds are tuned to it
LLAMA_TRAIN = dataclasses.replace(LLAMA_2, vocab_size=16, max_position_embeddings=512)
# 6 layers, 64 tokens: EAGLE-3 fuses the hidden states entering layers 2, L // 2 and L - 3
# (tests/test_published_heads, tests/test_checkpoint_inputs: heads written in these sizes)
LLAMA_6 = dataclasses.replace(LLAMA, vocab_size=64, num_layers=6, max_position_embeddings=8192)
# Llama 3.1's rope scaling and a single KV head (tests/test_blocks' layer parity)
LLAMA3_ROPE = dataclasses.replace(LLAMA, num_kv_heads=1, rope_theta=500000.0,
                                  rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64))
# q/k/v and o biases and q/k head norms, heads of 32 (tests/test_targets' layouts)
LLAMA_EXTRAS = dataclasses.replace(LLAMA, vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_layers=2, head_dim=32, attention_bias=True, o_bias=True,
                                   qk_norm=True)
# an LM head of its own (not the embedding): tests/test_head_layouts' target, whose next
# token is a permutation of the current one (embedding and LM head set apart)
LLAMA_UNTIED = dataclasses.replace(LLAMA, tie_embeddings=False)
# 40 tokens, 1024 positions: character-level text (tests/test_text_corpus: 1 + ord % 38)
LLAMA_TEXT = dataclasses.replace(LLAMA_TRAIN, vocab_size=40, max_position_embeddings=1024)
# 100 tokens: the character-level chat tokenizer of ``chat_tokenizer`` (tests/test_conversations)
LLAMA_CHAT = dataclasses.replace(LLAMA_TRAIN, vocab_size=100, max_position_embeddings=1024)
GEMMA = gemma.GemmaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8,
                          layer_types=("sliding", "full"), sliding_window=4)
# Gemma 4 at the conformance vocabulary: sliding and full layers of their own geometry (K as
# V on the full ones), the last two sharing the first two's keys and values (double-wide
# MLPs), per-layer embeddings and a window of 4: the ``mtp`` method's target
GEMMA4 = gemma4.Gemma4Config(
    vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=8, layer_types=("sliding", "full", "sliding", "full"),
    global_head_dim=16, num_global_kv_heads=1, attention_k_eq_v=True, sliding_window=4,
    partial_rotary_factor=0.25, final_logit_softcapping=30.0, hidden_size_per_layer_input=4,
    vocab_size_per_layer_input=V, num_kv_shared_layers=2, use_double_wide_mlp=True,
    max_position_embeddings=256)
# (text, chat?) prompts for the real SmolLM2-135M tests: copying, repetition, chat, code
SMOLLM_PROMPTS = [
    ("Summarize: The cat sat on the mat. The cat was happy on the mat.", False),
    ("Repeat after me: one two three four, one two three four,", False),
    ("List the planets of the solar system in order.", True),
    ("def add(a, b):\n    return a + b\n\ndef sub(a, b):", False),
]
T5 = t5.T5Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                 num_encoder_layers=2, num_heads=4, head_dim=8, num_buckets=8, max_distance=20)


@functools.lru_cache(maxsize=None)
def _llama_params(seed: int, scale: float, config: LlamaConfig):
    return jax.tree.map(lambda x: x * scale, llama_init(config, jax.random.key(seed)))


def llama_params(seed: int = 1, scale: float = 3.0, config: LlamaConfig = LLAMA):
    """Random ``config`` parameters from ``jax.random.key(seed)``, times ``scale`` (3.0: sharper,
    context-dependent logits). The arrays are computed once per process; each call gets its
    own dicts and lists, so a test may replace entries without affecting another."""
    return jax.tree.map(lambda x: x, _llama_params(seed, scale, config))


def llama(seed: int = 1, scale: float = 3.0):
    """``(Llama(LLAMA), llama_params(seed, scale))``."""
    return Llama(LLAMA), llama_params(seed, scale)


@functools.lru_cache(maxsize=None)
def _gemma4_params(seed: int, scale: float):
    p = gemma4.init_params(GEMMA4, jax.random.key(seed), scale=scale)
    for lp in p["layers"]:  # blocks outweigh the embedding: outputs depend on the context
        lp.update({n: lp[n] * 4.0 for n in ("post_attn_norm", "post_mlp_norm")})
    return p


def gemma4_toy(seed: int = 1, scale: float = 0.5):
    """``(Gemma4(GEMMA4), params)``: random weights (normal with ``scale``, gains near 1,
    the blocks' output norms near 4 so that the next token depends on the context, not
    only on the last one), computed once per process; each call gets its own dicts."""
    return gemma4.Gemma4(GEMMA4), jax.tree.map(lambda x: x, _gemma4_params(seed, scale))


def lm_for(spec: str, llama_lm: "ToyLM") -> "ToyLM":
    """The toy a method's tiny ``spec`` runs on: ``llama_lm``, or for a method that drafts
    for one family only (``Method.family``: ``mtp``'s Gemma 4) that family's toy."""
    from specjax import methods

    family = type(methods.parse(spec)).family
    if family is None:
        return llama_lm
    if family != "Gemma4":
        raise ValueError(f"no toy of family {family!r} (tests/toys.py)")
    return ToyLM(*gemma4_toy(), eos_ids=())


def toy_lm(config: LlamaConfig, seed: int) -> "ToyLM":
    """A ``ToyLM`` of ``Llama(config)`` with ``llama_params(seed, 3.0, config)``."""
    return ToyLM(Llama(config), llama_params(seed, 3.0, config))


def answered_prompts(lm, seed: int, n: int = 24, max_new_tokens: int = 24):
    """``n`` random prompts of 3-19 tokens (``np.random.default_rng(seed)``) answered
    greedily by ``lm``: a distillation corpus (``distill.answer_batch``)."""
    import numpy as np

    from specjax.train import distill

    rng = np.random.default_rng(seed)
    v = lm.model.config.vocab_size
    prompts = [list(rng.integers(1, v, size=k)) for k in rng.integers(3, 20, size=n)]
    return distill.answer_batch(lm, prompts, max_new_tokens=max_new_tokens)


@dataclasses.dataclass
class ToyLM:
    """The part of ``LoadedModel`` that training and export code reads."""
    model: Llama
    params: dict
    eos_ids: tuple = (0,)
    mesh: None = None  # not placed on a mesh


class ByteTokenizer:
    """A tokenizer for toy models: one id per byte of the text (offset past the special ids
    0-2), at most ``limit`` ids, no chat template."""

    chat_template = None

    def __init__(self, vocab_size: int, limit: int = 40):
        self.vocab_size, self.limit = vocab_size, limit

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + b % (self.vocab_size - 3) for b in text.encode()][: self.limit]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


def loaded_llama(path, seed: int = 0, layers: int = 4):
    """A ``specjax.models.LoadedModel`` of a random ``layers``-layer Llama saved as an HF
    directory at ``path`` (so transformers loads the same weights: ``bench.load_hf``), with
    a ``ByteTokenizer``: what the CLI's commands read, at a toy's compile cost."""
    import torch
    import transformers

    from specjax.models import load

    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharp logits: no near-ties between float32 implementations
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.2 * torch.randn_like(p))
    model.save_pretrained(str(path))
    lm = load(str(path), tokenizer=False)
    return dataclasses.replace(lm, name="toy", tokenizer=ByteTokenizer(cfg.vocab_size),
                               eos_ids=())


@functools.partial(jax.jit, static_argnames=("model", "capacity", "return_layers"))
def forward(model, params, tokens, capacity: int = 128, return_layers: tuple = ()):
    """``model.forward`` over ``tokens`` [B, T] at positions ``0..T-1`` from an empty cache
    of ``capacity``: ``(logits, hidden, cache)``. Jitted and shared by the tests' references
    (eager, a toy's forward is hundreds of small operations: seconds a sequence)."""
    import jax.numpy as jnp

    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return model.forward(params, tokens, pos, model.init_cache(tokens.shape[0], capacity),
                         return_layers=return_layers)


def start_context(model, params, prompt: list[int], capacity: int = 128, chunk: int = 16):
    """The ``Context`` a drafter starts from: ``prompt`` (batch 1) prefilled into a fresh cache
    of ``capacity`` in chunks of ``chunk``, every position's hidden state kept, and the
    target's greedy first token written after it (jitted, as decoding runs it)."""
    import jax.numpy as jnp

    buf = jnp.zeros((1, capacity), jnp.int32).at[0, :len(prompt)].set(jnp.asarray(prompt))
    return _prefilled(model, params, buf, jnp.asarray([len(prompt)]), chunk)


@functools.partial(jax.jit, static_argnames=("model", "chunk"))
def _prefilled(model, params, buf, p, chunk):
    import jax.numpy as jnp

    from specjax.core.decoding import prefill
    from specjax.drafters import Context

    h_last, cache, h_all = prefill(model, params, buf, p, model.init_cache(1, buf.shape[1]),
                                   chunk, True)
    first = jnp.argmax(model.logits(params, h_last), -1)
    return Context(tokens=buf.at[0, p[0]].set(first[0]), length=p + 1, prompt_len=p,
                   cache=cache, params=params, hidden=h_all)


BF16_STEP = 2.0 ** -7  # one bfloat16 ulp, relative: 8 significant bits


def assert_within_a_bf16_step(got, want, atol: float = 1e-5) -> None:
    """``got`` (stored in bfloat16) is ``want`` (float32) rounded to bfloat16, give or take
    one bfloat16 step: ``|got - want| <= 2^-7 |want| + atol`` elementwise. Rounding alone
    errs by half a step; the other half allows float32 differences between the program that
    stored ``got`` and the one computing ``want`` to flip a rounding."""
    import numpy as np

    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=BF16_STEP, atol=atol)


# For child processes that run only toy models: XLA:CPU's loop emitters instead of its
# fusion emitters. Measured on this CPU (2 cores): the toy sharding run (tests/test_sharding.py,
# 8 simulated devices) took 110 s of CPU instead of 138 s, the device check's --small run
# 120 s instead of 131 s (compiling dominates toys), but SmolLM2-135M's real-weight decoding
# tests took twice the CPU time, so the suite's own workers keep XLA's default.
TOY_XLA_FLAG = "--xla_cpu_use_fusion_emitters=false"


def toy_process_env(env: dict) -> dict:
    """``env`` with ``TOY_XLA_FLAG`` added to its ``XLA_FLAGS`` (for a toy-only child)."""
    flags = env.get("XLA_FLAGS", "")
    if "xla_cpu_use_fusion_emitters" not in flags:
        flags = f"{flags} {TOY_XLA_FLAG}".strip()
    return {**env, "XLA_FLAGS": flags}


def device_check():
    """``scripts/device_check.py`` as the module ``device_check_script``, imported once per
    process (the device check is a script, not part of the package)."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "device_check_script"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "scripts" / "device_check.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: its dataclasses look it up
        spec.loader.exec_module(module)
    return sys.modules[name]

# ----------------------------------------------------------------------------- conformance
# ragged: prompt lengths 5, 3, 20, 1; budgets 20, 7, 33, 12
PROMPTS = [[1, 5, 2, 7, 5], [3, 3, 1], [1, 5, 2, 7, 5] * 4, [7]]
BUDGETS = [20, 7, 33, 12]


def _options():
    from specjax import methods

    return methods.Options(model_name="toy", layers=(1, 2))  # plain exits, no shipped heads


OPTIONS = _options()


def conformance_specs(family: str | None = None) -> list[str]:
    """Every registered decoding method's tiny specs (``Method.tiny``, sized for ``llama``'s
    3 layers and 12 tokens; a method of one family's for that family's toy: ``lm_for``),
    in registry order; with ``family``, those that draft for it."""
    from specjax import methods

    return [s for cls in methods.registered() if cls.decodes
            and (family is None or cls.family in (None, family)) for s in cls.tiny]


def sweep_specs(skip: dict | None = None, extra: tuple = (), family: str = "Llama",
                own: bool = False) -> list[str]:
    """The per-family sweeps' specs (scan layers, bfloat16, a mesh): every registered
    decoding method's first tiny spec (``Method.tiny[0]``) that drafts for ``family`` (a
    method with no ``Method.family`` drafts for any), without the kinds in ``skip`` (kind
    -> why that family cannot run it, said where the sweep calls this), then ``extra``.
    With ``own``, ``ar`` and the methods that draft for ``family`` alone: a family whose
    model the Llama sweeps already cover method by method (Gemma 4's, with ``mtp``). A
    method registered later joins every sweep of its families."""
    from specjax import methods

    skip = skip or {}
    return [cls.tiny[0] for cls in methods.registered()
            if cls.decodes and cls.tiny and cls.kind not in skip
            and (cls.family == family or (cls.family is None and
                                          (not own or cls.kind == "ar")))] + list(extra)


def run_spec(spec: str, model, params, prompts, budgets, mesh=None):
    """``spec`` built through the registry on ``model`` (random heads from one key, as the
    conformance test builds them; on ``mesh``, the weights placed first) and decoded
    greedily."""
    from specjax import methods, sharding

    if mesh is not None:
        params = sharding.shard_params(model.config, params, mesh)
    lm = ToyLM(model, params, eos_ids=(), mesh=mesh)
    built = methods.parse(spec).random(lm, OPTIONS, jax.random.key(3))
    return built(prompts, max_new_tokens=budgets)


def one_line(e, *fragments: str) -> str:
    """The message of a raised exception (``pytest.raises``' ``ExceptionInfo`` ``e``),
    asserted to be one line holding every fragment."""
    msg = str(e.value)
    assert "\n" not in msg, msg
    for f in fragments:
        assert f in msg, msg
    return msg


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer(template: str | None = CHATML):
    """A transformers fast tokenizer of 100 ids: ``<pad>`` 0, ``<s>`` 1 (BOS),
    ``<|im_start|>`` 2, ``<|im_end|>`` 3 (EOS), then one id per printable ASCII character
    and newline; ChatML's template (``template``; None: none, a base model's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "<|im_start|>": 2, "<|im_end|>": 3}
    for c in [chr(c) for c in range(32, 127)] + ["\n"]:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    t = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                pad_token="<pad>",
                                additional_special_tokens=["<|im_start|>"])
    t.chat_template = template
    return t
