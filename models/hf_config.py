"""HF ``config.json`` values read with their types checked (``ConfigFields``), and RoPE
fields as transformers 5 reads them (``hf_rope``): a missing key or a value of the wrong
type is one line naming the file and the key. Each family's parser (``llama_load.hf_config``,
``gemma_load.hf_gemma_config``, ``t5_load.hf_t5_config``) reads its fields through these.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Callable, NoReturn

from specjax.models.base import RopeScaling
from specjax.models.streaming import WeightLoadError

#: the default of a read that has none: the key is required
ABSENT = object()


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclasses.dataclass(frozen=True)
class ConfigFields:
    """Typed reads of one ``config.json`` object ``d`` (``where`` names the file). A read
    returns the value at ``key``, or ``default`` where the key is absent or null; a required
    key that is absent, or a value of the wrong type, raises ``error`` in one line naming
    the file and the key (``prefix + key`` inside a nested object)."""

    d: dict
    where: str = "config.json"
    error: type = WeightLoadError
    prefix: str = ""

    def fail(self, msg: str) -> NoReturn:
        raise self.error(f"{self.where}: {msg}")

    def name(self, key: str) -> str:
        return repr(self.prefix + key)

    def value(self, key: str, default, ok: Callable[[object], bool], what: str):
        """``d[key]`` where ``ok`` accepts it (``what`` describes what it accepts)."""
        v = self.d.get(key)
        if v is None:
            if default is ABSENT:
                self.fail(f"{self.name(key)} is missing")
            return default
        if not ok(v):
            self.fail(f"{self.name(key)} must be {what}, got {v!r}")
        return v

    def integer(self, key: str, default=ABSENT, minimum: int = 1) -> int:
        return self.value(key, default, lambda v: is_int(v) and v >= minimum,
                          f"an integer >= {minimum}")

    def number(self, key: str, default=ABSENT, positive: bool = False) -> float:
        v = self.value(key, default, lambda v: is_number(v) and (v > 0 or not positive),
                       "a positive number" if positive else "a number")
        return v if v is None else float(v)

    def flag(self, key: str, default=ABSENT) -> bool:
        return self.value(key, default, lambda v: isinstance(v, bool), "true or false")

    def text(self, key: str, default=ABSENT) -> str:
        return self.value(key, default, lambda v: isinstance(v, str), "a string")

    def texts(self, key: str, default=ABSENT) -> list[str]:
        return self.value(key, default, lambda v: isinstance(v, list) and all(
            isinstance(x, str) for x in v), "a list of strings")

    def integers(self, key: str, default=ABSENT) -> list[int]:
        return self.value(key, default, lambda v: isinstance(v, list) and all(
            is_int(x) for x in v), "a list of integers")

    def obj(self, key: str) -> ConfigFields:
        """The object at ``key`` (empty where absent or null), its keys named ``key.*``."""
        v = self.value(key, {}, lambda v: isinstance(v, dict), "an object")
        return dataclasses.replace(self, d=v, prefix=f"{self.prefix}{key}.")


def read_config_json(f: Path, error: type = WeightLoadError) -> ConfigFields:
    """The JSON object in file ``f``, for typed reads; ``error`` naming ``f`` for a file
    that cannot be read, is not JSON, or holds something else than an object."""
    try:
        d = json.loads(Path(f).read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError included
        raise error(f"{f}: not a readable JSON file ({e})") from None
    if not isinstance(d, dict):
        raise error(f"{f}: holds a JSON {type(d).__name__}, not an object")
    return ConfigFields(d, str(f), error)


def config_fields(d: dict | ConfigFields) -> ConfigFields:
    """``d`` for typed reads (a ``ConfigFields`` as it is)."""
    return d if isinstance(d, ConfigFields) else ConfigFields(d)


#: the RoPE types ``RopeScaling`` computes
ROPE_TYPES = ("default", "linear", "llama3")


def rope_block(f: ConfigFields, theta: float, max_positions: int | None = None,
               dynamic_ok: bool = False) -> tuple[float, RopeScaling]:
    """RoPE base and scaling of one flat RoPE object ``f``, as transformers 5 standardizes
    and validates it (``modeling_rope_utils``): type ``rope_type``, else the v4 ``type``,
    else default; base ``rope_theta``, else ``theta``; the fields its type requires
    (linear: ``factor``; llama3: ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings``, which defaults to ``max_positions`` where that is
    given). With ``dynamic_ok``, ``dynamic`` reads as default (it changes nothing within
    ``max_position_embeddings``). ``f.error`` naming the key for another type, a missing
    field, a value of the wrong type, or a ``partial_rotary_factor`` other than 1."""
    if {"full_attention", "sliding_attention"} & set(f.d):
        f.fail(f"{f.prefix[:-1]!r} is nested by layer type, but this family reads one flat "
               "RoPE object")
    tkey = "rope_type" if f.d.get("rope_type") is not None else "type"
    kind = f.text(tkey, "default")
    if kind == "dynamic" and dynamic_ok:
        kind = "default"
    if kind not in ROPE_TYPES:
        f.fail(f"{f.name(tkey)} {kind!r} is not supported ({', '.join(ROPE_TYPES)})")
    if f.number("partial_rotary_factor", 1.0) != 1.0:
        f.fail(f"{f.name('partial_rotary_factor')} other than 1 is not supported (RoPE over "
               "the whole head)")
    theta = f.number("rope_theta", theta, positive=True)
    if kind == "default":
        return theta, RopeScaling()
    factor = f.number("factor", positive=True)
    if kind == "linear":
        return theta, RopeScaling("linear", factor)
    return theta, RopeScaling(
        "llama3", factor, f.number("low_freq_factor", positive=True),
        f.number("high_freq_factor", positive=True),
        f.integer("original_max_position_embeddings",
                  ABSENT if max_positions is None else max_positions))


def hf_rope(d: dict | ConfigFields, default_theta: float = 10000.0,
            dynamic_ok: bool = False) -> tuple[float, RopeScaling]:
    """RoPE base and scaling of a config whose layers share one RoPE (Llama, Qwen, Gemma 2,
    EAGLE heads), read as transformers 5.24 reads it
    (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict``): a non-empty v4
    ``rope_scaling`` replaces ``rope_parameters`` whole, else ``rope_parameters`` is read;
    a base that object lacks is the top-level ``rope_theta``, else ``default_theta`` (so
    beside a non-empty ``rope_scaling``, ``rope_parameters``' own ``rope_theta`` is not
    read, as in transformers). Fields and errors: :func:`rope_block`."""
    f = config_fields(d)
    if f.number("partial_rotary_factor", 1.0) != 1.0:
        f.fail("'partial_rotary_factor' other than 1 is not supported (RoPE over the whole "
               "head)")
    key = "rope_scaling" if f.d.get("rope_scaling") else "rope_parameters"
    return rope_block(f.obj(key), f.number("rope_theta", default_theta, positive=True),
                      f.integer("max_position_embeddings", None), dynamic_ok)
