"""The model-family registry: what loading needs to know of each family, registered by the
family's own loading module (``llama_load``, ``gemma_load``, ``t5_load``; imported by
``loading``). A new family is its model module, its loading module (config parsers, weight
tables, one ``register_family``) and that module's name in ``loading``'s imports; another
``model_type`` of an existing family is one more name in its ``hf_model_types``."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family as loading sees it: ``config``, its config class; ``model``, a
    function returning its model class (imported when a model is built); ``hf_config``,
    parsing an HF ``config.json`` (``ConfigFields``) of one of ``hf_model_types``; and the
    GGUF ``general.architecture``s it reads, with ``gguf_config`` parsing that metadata
    (``GGUFFile``).

    Weights: ``hf_keys`` and ``gguf_keys`` map the tensor names of each format to ours
    (``(source pattern with {i} for the layer, our unfused name, transform)``, streamed by
    ``streaming.stream_params``); ``layer_norms``, the per-layer norm gains of shape
    ``[hidden]`` it stores beyond ``attn_norm`` and ``mlp_norm``. A family whose HF tensors
    are mapped whole instead (T5) gives ``hf_params(cfg, tensors, path, dtype)``, returning
    ``(cfg, params)`` from every tensor read in float32. A family whose layers differ in
    shape (Gemma 4) streams its HF tensors itself: ``hf_stream(cfg, src, path, dtype,
    mesh)`` returns the params, read tensor by tensor from ``src`` (a ``TensorSource``).
    A family imports its own model module only when a model is built, except its config
    class (``config``), which its loading module holds."""

    name: str
    config: type
    model: Callable[[], type]
    hf_config: Callable
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...] = ()
    gguf_config: Callable | None = None
    hf_keys: tuple = ()
    gguf_keys: tuple = ()
    layer_norms: tuple[str, ...] = ()
    hf_params: Callable | None = None
    hf_stream: Callable | None = None


FAMILIES: dict[str, Family] = {}  # by name, in registration order


def register_family(fam: Family) -> Family:
    """Adds ``fam`` to ``FAMILIES`` (``ValueError`` for a name or ``model_type`` taken)."""
    taken = {t for f in FAMILIES.values() for t in f.hf_model_types}
    if fam.name in FAMILIES or taken & set(fam.hf_model_types):
        raise ValueError(f"family {fam.name!r} or one of its model types "
                         f"{fam.hf_model_types} is registered already")
    FAMILIES[fam.name] = fam
    return fam


def model_class(module: str, name: str) -> Callable[[], type]:
    """``Family.model`` for class ``name`` of ``specjax.models.<module>``."""
    def model():
        return getattr(importlib.import_module(f"specjax.models.{module}"), name)
    return model


def family_of(cfg) -> Family:
    """The registered family whose config class is exactly ``type(cfg)``. A subclass of a
    family's config is not that family (it may compute something the port does not):
    ``TypeError`` naming it, as for any config no family registers."""
    for fam in FAMILIES.values():
        if type(cfg) is fam.config:
            return fam
    near = [f.name for f in FAMILIES.values() if isinstance(cfg, f.config)]
    why = (f"; it subclasses {near[0]}'s {FAMILIES[near[0]].config.__name__}: register its "
           "own family (specjax.models.families.register_family)") if near else ""
    raise TypeError(f"no model family is registered for {type(cfg).__name__} "
                    f"(registered: {', '.join(FAMILIES)}){why}")


def family(cfg) -> str:
    """The name of ``cfg``'s family: ``Llama``, ``Gemma``, ``T5`` or a registered one."""
    return family_of(cfg).name


def model_for(cfg, compute_dtype=jnp.float32):
    """The model class instance for a config (its family's: ``Llama``, ``Gemma``, ``T5``),
    multiplying in ``compute_dtype``."""
    return family_of(cfg).model()(cfg, compute_dtype)


def hf_family(kind: str) -> Family | None:
    """The family reading HF ``model_type`` ``kind``; None if none does."""
    return next((f for f in FAMILIES.values() if kind in f.hf_model_types), None)


def gguf_family(arch: str) -> Family | None:
    """The family reading GGUF ``general.architecture`` ``arch``; None if none does."""
    return next((f for f in FAMILIES.values() if arch in f.gguf_architectures), None)
