"""The method registry: every decoding method is one spec class, registered here, that owns
its text form, its checks, how it builds, its random-weight build for the device check, its
head directory option and its CLI help line.

Text forms (``parse`` / ``MethodSpec.format``; ``parse(m.format()) == m``):

* ``ar``: plain autoregressive decoding;
* ``sd-ngram[:depth]``, ``sd-early-exit:L``: speculative decoding with prompt lookup or
  the target's first ``L`` layers;
* ``eagle2[:depth,topk,total][:conf,norerank,fullvocab,vocab=N]``: EAGLE-2's head and
  dynamic tree (an exported head: ``Options.draft_checkpoint``, default the shipped one);
  a published EAGLE-1/2 head directory (``specjax.heads.published``) works too;
* ``eagle3[:depth,topk,total][:conf,norerank]``: a published EAGLE-3 head
  (``Options.draft_checkpoint``) over the target's fused hidden states;
* ``redrafter[:W,L][:nodedup]``: ReDrafter's beams as one tree
  (``Options.redrafter_checkpoint``);
* ``dflash[:depth[,topk,total]]``: a DFlash block drafter (``Options.draft_checkpoint``,
  z-lab's hub layout), verified as a chain or a tree of each slot's top-k;
* ``mtp[:depth[,topk,total]]``: a Gemma 4 target's MTP assistant
  (``Options.draft_checkpoint``, transformers' layout) as a chain or a dynamic tree;
* ``hsd[:SPEC]``: a hierarchy (``specjax.hsd.HierarchySpec``; bare ``hsd`` is tuned from
  ``Options.calibration``);
* ``hf``, ``hf-pld``, ``hf-mtp[:depth]``: the transformers peers a benchmark compares
  against (not decoders): ``generate``, prompt lookup, and assisted generation with a
  Gemma 4 assistant.

Where dispatch happens: on the spec's own class. ``parse`` and ``split`` pick the
registered class whose prefix matches the text (the longest one), ``check(spec, options)``
calls ``spec.check``, ``build(spec, lm, options)`` calls ``spec.build``, and the device
check calls ``spec.random``. ``forms()`` (``FORMS``), the CLI's ``--method`` help and
completion flags, ``specjax bench``, the demo's candidates (``Method.demo``), the device
check's methods (``Method.device``) and the tests' tiny specs (``Method.tiny``) read the
registered classes (``registered()``). Adding a method is one ``Method`` subclass decorated
with ``register`` (see ``Method``), in a module of its own; ``unregister`` removes one.

Layout: ``registry`` holds the machinery; each built-in method is one module here (``ar``,
``sd``, ``eagle``, ``redrafter``, ``hsd``, ``dflash``, ``mtp``, ``peer``), imported below
in registration order:
a new built-in method is its module and one import line.

``build`` returns a ``Built``: the decoder, its parameters and the spec as run, callable
like ``specjax.decode``.

Nothing is silently wrong: a spec no builder can run (an EAGLE tree with fewer nodes than
levels, an n-gram level above an exit) is a ``SpecError`` when constructed or parsed;
``check(spec, options)`` checks the head directories and calibration a spec reads before
any model loads (``build`` runs it first); a ``vocab=N`` runs exactly ``N`` tokens or is
refused; an argument of the wrong type is a one-line ``TypeError`` naming it.
"""

from __future__ import annotations

from specjax.methods.registry import (Built, CliOption, Method, MethodSpec, Options, SpecError,
                                       as_spec, build, check, forms, load_drafter, parse,
                                       register, registered, speculative, split, unregister)

# the built-in methods, one line each, in registration order (importing registers them)
from specjax.methods.ar import AR  # noqa: E402, F401, I001
from specjax.methods.sd import SD  # noqa: E402, F401
from specjax.methods.eagle import Eagle, Eagle3  # noqa: E402, F401
from specjax.methods.redrafter import Redrafter  # noqa: E402, F401
from specjax.methods.hsd import HSD  # noqa: E402, F401
from specjax.methods.hsd import draft_temperatures, exit_heads, read_calibration  # noqa: E402
from specjax.methods.dflash import DFlash  # noqa: E402, F401
from specjax.methods.mtp import MTP  # noqa: E402, F401
from specjax.methods.peer import Peer  # noqa: E402, F401

#: the classes registered by specjax itself (``registered()`` before any user registration)
BUILTINS = registered()


def __getattr__(name: str):
    """``FORMS``: ``forms()``, read when asked, so it includes later registrations."""
    if name == "FORMS":
        return forms()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [*(c.__name__ for c in BUILTINS), "BUILTINS", "MethodSpec", "Method", "CliOption",
           "Options", "Built", "SpecError", "register", "unregister", "registered", "forms",
           "parse", "split", "as_spec", "check", "build", "speculative", "load_drafter",
           "exit_heads", "read_calibration", "draft_temperatures", "FORMS"]
