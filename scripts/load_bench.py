"""Host memory and time of loading a sharded bfloat16 HF checkout: specjax without a mesh,
specjax onto a 1x8 mesh of simulated CPU devices, and transformers, each in a fresh process.

Writes a random Llama-shaped checkout (``config.json``, ``model-0000k-of-0000n.safetensors``
shards and ``model.safetensors.index.json``) to a temporary directory, then in a new
interpreter per loader records VmRSS once its libraries are imported (VmHWM reset there
through ``/proc/self/clear_refs``), loads with dtype bfloat16, and reports the peak RSS above
that baseline (VmHWM) and the wall time. On CPU the devices are host memory, so the loaded
weights themselves count in the peak: 1.0x the file bytes is the floor.

    .venv/bin/python scripts/load_bench.py --layers 14 --out docs/results/load_memory_cpu.json

``tests/test_loading_memory.py`` uses ``write_checkout`` and ``measure`` from here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODES = ("specjax", "specjax-mesh", "specjax-scan", "transformers")


def hf_config(layers: int, hidden: int = 1024, intermediate: int = 4096, vocab: int = 32000,
              heads: int = 16, kv_heads: int = 16) -> dict:
    """An untied Llama ``config.json`` of the given size, stored in bfloat16."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1,
            "eos_token_id": 2}


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """The HF tensor names and shapes of config ``c`` (``hf_config``), layer by layer."""
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = d // c["num_attention_heads"]
    nq, nk = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (v, d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (d,), p + "self_attn.q_proj.weight": (nq, d),
                    p + "self_attn.k_proj.weight": (nk, d), p + "self_attn.v_proj.weight": (nk, d),
                    p + "self_attn.o_proj.weight": (d, nq),
                    p + "post_attention_layernorm.weight": (d,),
                    p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                    p + "mlp.down_proj.weight": (d, f)})
    out.update({"model.norm.weight": (d,), "lm_head.weight": (v, d)})
    return out


def write_safetensors(path: Path, tensors: dict[str, tuple[tuple[int, ...], memoryview]]) -> int:
    """Writes bfloat16 tensors (name -> (shape, raw bytes)) as one safetensors file; returns
    its size in bytes."""
    header, at = {}, 0
    for name, (shape, raw) in tensors.items():
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [at, at + len(raw)]}
        at += len(raw)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # tensor data starts 8-byte aligned
    with open(path, "wb") as fh:
        fh.write(len(blob).to_bytes(8, "little"))
        fh.write(blob)
        for _, raw in tensors.values():
            fh.write(raw)
    return 8 + len(blob) + at


def write_checkout(path: Path, layers: int = 12, shards: int = 4, seed: int = 0,
                   **size) -> int:
    """A random bfloat16 Llama checkout in ``path``: ``config.json``, ``shards`` safetensors
    files of about equal size and ``model.safetensors.index.json``. Values are random
    finite bfloat16 (magnitudes 2^-8..2^-1, random signs), each tensor a different window
    of one random pool, so writing is fast. Returns the bytes of the safetensors files."""
    path.mkdir(parents=True, exist_ok=True)
    c = hf_config(layers, **size)
    shapes = tensor_shapes(c)
    biggest = max(int(np.prod(s)) for s in shapes.values())
    rng = np.random.default_rng(seed)
    pool = rng.integers(0x3b80, 0x3f00, 2 * biggest, dtype=np.uint16)
    pool |= rng.integers(0, 2, pool.size, dtype=np.uint16) << 15
    total = sum(int(np.prod(s)) * 2 for s in shapes.values())
    groups: list[dict] = [{} for _ in range(shards)]
    filled = 0
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        at = int(rng.integers(0, pool.size - n + 1))
        raw = memoryview(pool[at:at + n]).cast("B")
        groups[min(shards - 1, filled * shards // total)][name] = (shape, raw)
        filled += 2 * n
    weight_map, nbytes = {}, 0
    for k, g in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        nbytes += write_safetensors(path / fname, g)
        weight_map.update({name: fname for name in g})
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (path / "config.json").write_text(json.dumps(c, indent=1))
    return nbytes


_CHILD = r"""
import json, sys, time

def vm():
    d = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS", "VmHWM")):
            d[line.split(":")[0]] = int(line.split()[1]) * 1024
    return d

mode, path = sys.argv[1], sys.argv[2]
if mode.startswith("specjax"):
    import jax, jax.numpy as jnp, numpy as np
    import specjax.models, specjax.models.loading, specjax.sharding
    mesh = specjax.sharding.make_mesh(1, 8) if mode == "specjax-mesh" else None
    jax.device_put(np.zeros(8)).block_until_ready()  # the backend is up
    load = lambda: specjax.models.load(path, dtype=jnp.bfloat16, tokenizer=False, mesh=mesh,
                                       scan_layers=mode == "specjax-scan").params
else:
    import torch, transformers
    torch.set_num_threads(2)
    load = lambda: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
base = vm()["VmRSS"]
t = time.perf_counter()
loaded = load()
if mode.startswith("specjax"):
    jax.block_until_ready(loaded)
wall = time.perf_counter() - t
peak = vm()["VmHWM"]
out = {"mode": mode, "baseline_rss_bytes": base, "peak_over_baseline_bytes": peak - base,
       "wall_s": round(wall, 3)}
if mode.startswith("specjax"):
    per_device = {}
    for leaf in jax.tree.leaves(loaded):
        for s in leaf.addressable_shards:
            per_device[str(s.device)] = per_device.get(str(s.device), 0) + s.data.nbytes
    out.update(weights_bytes=sum(x.nbytes for x in jax.tree.leaves(loaded)),
               per_device_bytes=per_device)
else:  # its weights stay pages of the mapped files until read: read one value per page
    out.update(weights_bytes=sum(p.numel() * p.element_size() for p in loaded.parameters()))
    t = time.perf_counter()
    with torch.no_grad():
        for p in loaded.parameters():
            p.reshape(-1)[::2048].float().sum()
    out.update(peak_after_reading_weights_bytes=vm()["VmHWM"] - base,
               read_weights_s=round(time.perf_counter() - t, 3))
print("RESULT " + json.dumps(out))
"""


def start(path: Path, mode: str) -> subprocess.Popen:
    """A fresh interpreter loading the checkout at ``path`` the ``mode`` way (``MODES``);
    ``specjax-mesh`` runs with 8 simulated CPU devices and loads onto a 1x8 mesh,
    ``specjax-scan`` stacks the layers (``scan_layers=True``)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    env = dict(os.environ)
    if mode == "specjax-mesh":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            " --xla_force_host_platform_device_count=8").strip()
    return subprocess.Popen([sys.executable, "-c", _CHILD, mode, str(path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen, timeout: float = 300) -> dict:
    """The report of a process from :func:`start`; ``RuntimeError`` with its stderr if it
    failed."""
    out, err = proc.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"loader process failed ({proc.returncode}):\n{err[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def measure(path: Path, mode: str, timeout: float = 300) -> dict:
    """:func:`start` then :func:`result`: one load in a fresh process."""
    return result(start(path, mode), timeout)


def summarize(reps: list[dict], nbytes: int) -> dict:
    """One mode's repeats: the last report, with the median wall time and the largest peak
    over all repeats, the peaks as multiples of the file bytes, and the largest device's
    share of the weights."""
    r = dict(reps[-1])
    r["wall_s_each"] = [x["wall_s"] for x in reps]
    r["wall_s"] = float(np.median(r["wall_s_each"]))
    for key, ratio in (("peak_over_baseline_bytes", "peak_over_file_bytes"),
                       ("peak_after_reading_weights_bytes",
                        "peak_after_reading_weights_over_file_bytes")):
        if key in r:
            r[key] = max(x[key] for x in reps)
            r[ratio] = round(r[key] / nbytes, 3)
    if "read_weights_s" in r:
        r["read_weights_s"] = float(np.median([x["read_weights_s"] for x in reps]))
    if "per_device_bytes" in r:
        r["max_device_fraction"] = round(max(r["per_device_bytes"].values())
                                         / r["weights_bytes"], 4)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=14, help="decoder layers (14: about 0.6 GB)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated of {MODES}")
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes per mode")
    ap.add_argument("--out", type=Path, help="write the report here (JSON)")
    args = ap.parse_args()
    from specjax import bench

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        nbytes = write_checkout(Path(tmp), args.layers, args.shards)
        print(f"checkout: {nbytes / 1e9:.3f} GB in {args.shards} shards", file=sys.stderr)
        runs = {}
        for mode in args.modes.split(","):
            runs[mode] = summarize([measure(Path(tmp), mode) for _ in range(args.repeat)],
                                   nbytes)
            print(f"{mode}: peak {runs[mode]['peak_over_file_bytes']}x file bytes, "
                  f"{runs[mode]['wall_s']} s", file=sys.stderr)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "models", "specjax",
                            "scripts/load_bench.py"], cwd=ROOT).returncode != 0
    report = {"command": "python scripts/load_bench.py " + " ".join(sys.argv[1:]),
              "git_commit": commit, "uncommitted_loader_changes": dirty,
              "machine": bench.machine_info(),
              "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "checkout": {"config": hf_config(args.layers), "shards": args.shards,
                           "file_bytes": nbytes, "dtype": "bfloat16"},
              "note": "peak = VmHWM above VmRSS after imports, in a fresh process per "
                      "loader; on CPU the loaded weights are host memory and count in it. "
                      "specjax-mesh places onto a data=1, model=8 mesh of simulated CPU "
                      "devices; specjax-scan stacks the layers (scan_layers=True), holding "
                      "one weight of all layers on the host at a time. transformers leaves "
                      "bfloat16 weights as pages of the memory-mapped files, read on first "
                      "use: its load peak and time "
                      "exclude reading them; *_after_reading_weights adds reading one value "
                      "per page of every weight. load_average_1m: before and after (other "
                      "work on the machine makes wall times noisy)", "runs": runs}
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
