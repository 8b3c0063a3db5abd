"""Host memory and time of loading a sharded bfloat16 HF checkout: specjax without a mesh,
specjax onto a 1x8 mesh of simulated CPU devices, and transformers, each in a fresh process;
and specjax onto one mesh of 4 simulated devices, as 1 process or as 2 processes of 2
devices each (``specjax.distributed.launch``), where each process reads and holds only its
devices' slices.

Writes a random Llama-shaped checkout (``config.json``, ``model-0000k-of-0000n.safetensors``
shards and ``model.safetensors.index.json``) to a temporary directory, then in a new
interpreter per loader records VmRSS once its libraries are imported (VmHWM reset there
through ``/proc/self/clear_refs``), loads with dtype bfloat16, and reports the peak RSS above
that baseline (VmHWM) and the wall time. On CPU the devices are host memory, so the loaded
weights themselves count in the peak: 1.0x the file bytes is the floor (for one process
of several: the bytes its own devices hold).

    .venv/bin/python scripts/load_bench.py --layers 14 --out docs/results/load_memory_cpu.json
    .venv/bin/python scripts/load_bench.py --layers 14 --modes multiprocess \
        --out docs/results/load_memory_multiprocess_cpu.json

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

from specjax.jax_setup import setup_jax  # noqa: E402

setup_jax()  # as the specjax commands run: XLA:CPU's in-place flag, the compilation cache

ROOT = Path(__file__).resolve().parents[1]
#: specjax loads: (processes, simulated CPU devices per process, mesh (data, model) or None,
#: scan_layers); each process of a multi-process load joins one run over every device
SETUPS = {"specjax": (1, 1, None, False), "specjax-mesh": (1, 8, (1, 8), False),
          "specjax-scan": (1, 1, None, True), "specjax-model4": (1, 4, (1, 4), False),
          "specjax-2proc-model4": (2, 2, (1, 4), False),
          "specjax-2proc-model4-scan": (2, 2, (1, 4), True),
          "specjax-2proc-data2-model2": (2, 2, (2, 2), False)}
MODES = (*SETUPS, "transformers")
#: the modes ``--modes`` runs by default, and those ``--modes multiprocess`` names
DEFAULT_MODES = ("specjax", "specjax-mesh", "specjax-scan", "transformers")
MULTIPROCESS_MODES = ("specjax", "specjax-model4", "specjax-2proc-model4",
                      "specjax-2proc-model4-scan", "specjax-2proc-data2-model2")


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

mode, path, setup = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if mode.startswith("specjax"):
    if len(sys.argv) > 4:  # one process of a multi-process run
        from specjax import distributed
        distributed.initialize(distributed.Settings(sys.argv[4], int(sys.argv[5]),
                                                    int(sys.argv[6])))
    import jax, jax.numpy as jnp, numpy as np
    import specjax.models, specjax.models.loading, specjax.sharding
    _, _, shape, scan = setup
    mesh = specjax.sharding.make_mesh(*shape) if shape else None
    jax.device_put(np.zeros(8)).block_until_ready()  # the backend is up
    load = lambda: specjax.models.load(path, dtype=jnp.bfloat16, tokenizer=False, mesh=mesh,
                                       scan_layers=scan).params
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
               per_device_bytes=per_device, process_bytes=sum(per_device.values()),
               process_index=jax.process_index(), process_count=jax.process_count())
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


def _argv(path: Path, mode: str) -> list[str]:
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    return [sys.executable, "-c", _CHILD, mode, str(path), json.dumps(SETUPS.get(mode))]


def start(path: Path, mode: str) -> subprocess.Popen:
    """A fresh interpreter loading the checkout at ``path`` the ``mode`` way (a one-process
    mode of ``MODES``): with ``SETUPS[mode]``'s simulated CPU devices, mesh and
    ``scan_layers`` (``specjax-mesh``: a 1x8 mesh; ``specjax-scan``: stacked layers)."""
    env = dict(os.environ)
    devices = SETUPS.get(mode, (1, 1))[1]
    if SETUPS.get(mode, (1,))[0] != 1:
        raise ValueError(f"mode {mode!r} runs several processes: use measure()")
    argv = _argv(path, mode)
    if devices > 1:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            f" --xla_force_host_platform_device_count={devices}").strip()
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def result(proc: subprocess.Popen, timeout: float = 300) -> dict:
    """The report of a process from :func:`start`; ``RuntimeError`` with its stderr if it
    failed."""
    out, err = proc.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"loader process failed ({proc.returncode}):\n{err[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def measure_processes(path: Path, mode: str, timeout: float = 300) -> dict:
    """One load as ``SETUPS[mode]``'s processes of one run (``specjax.distributed.launch``,
    each reporting as :func:`result` does): process 0's report with ``processes`` (each
    process's report) and the largest peak of any process."""
    from specjax import distributed

    processes, devices = SETUPS[mode][:2]
    runs = distributed.launch(_argv(path, mode) + ["{coordinator}", "{num_processes}",
                                                   "{process_id}"],
                              processes, devices=devices, timeout=timeout)
    reports = []
    for r in runs:
        lines = [ln for ln in r.output.splitlines() if ln.startswith("RESULT ")]
        if r.returncode or not lines:
            raise RuntimeError(f"loader process {r.process_id} failed ({r.returncode}):\n"
                               f"{r.output[-3000:]}")
        reports.append(json.loads(lines[-1][len("RESULT "):]))
    out = dict(reports[0], processes=reports)
    for key in ("peak_over_baseline_bytes", "process_bytes", "wall_s"):
        out[key] = max(r[key] for r in reports)
    return out


def measure(path: Path, mode: str, timeout: float = 300) -> dict:
    """One load in fresh processes: :func:`start` then :func:`result`, or
    :func:`measure_processes` for a mode of several processes."""
    if SETUPS.get(mode, (1,))[0] > 1:
        return measure_processes(path, mode, timeout)
    return result(start(path, mode), timeout)


def summarize(reps: list[dict], nbytes: int) -> dict:
    """One mode's repeats: the last report, with the median wall time and the largest peak
    over all repeats (and over processes), the peaks and the bytes a process's devices hold
    as multiples of the file bytes, and the largest device's share of the weights."""
    r = dict(reps[-1])
    if "processes" in r:
        r["peak_over_baseline_bytes_each_process"] = [
            max(x["processes"][i]["peak_over_baseline_bytes"] for x in reps)
            for i in range(len(r["processes"]))]
        r["process_bytes_each_process"] = [p["process_bytes"] for p in r.pop("processes")]
    r["wall_s_each"] = [x["wall_s"] for x in reps]
    r["wall_s"] = float(np.median(r["wall_s_each"]))
    for key, ratio in (("peak_over_baseline_bytes", "peak_over_file_bytes"),
                       ("peak_after_reading_weights_bytes",
                        "peak_after_reading_weights_over_file_bytes")):
        if key in r:
            r[key] = max(x[key] for x in reps)
            r[ratio] = round(r[key] / nbytes, 3)
    if "process_bytes" in r:
        r["process_bytes_over_file_bytes"] = round(r["process_bytes"] / nbytes, 3)
        r["peak_over_process_bytes"] = round(r["peak_over_baseline_bytes"]
                                             / r["process_bytes"], 3)
    if "read_weights_s" in r:
        r["read_weights_s"] = float(np.median([x["read_weights_s"] for x in reps]))
    if "per_device_bytes" in r:
        r["max_device_fraction"] = round(max(r["per_device_bytes"].values())
                                         / r["weights_bytes"], 4)
    return r


_MESH4 = tuple(m for m in SETUPS if m == "specjax-model4" or "2proc" in m)
#: the code a load runs here: ``uncommitted_loader_changes`` says whether any differs from HEAD
LOADER_FILES = ("models", "specjax/sharding.py", "specjax/distributed.py",
                "scripts/load_bench.py")
NOTES = [  # (the modes it is about, none for every report; what their numbers mean)
    ((), "peak = VmHWM above VmRSS after imports (and, for one process of several, after "
         "joining the run), in a fresh process per loader; on CPU the loaded weights are "
         "host memory and count in it. load_average_1m: before and after (other work on "
         "the machine makes wall times noisy)."),
    (("specjax-mesh",), "specjax-mesh places onto a data=1, model=8 mesh of simulated CPU "
                        "devices."),
    (("specjax-scan",), "specjax-scan stacks the layers (scan_layers=True), holding one "
                        "weight of all layers on the host at a time."),
    (_MESH4, "specjax-model4 and specjax-2proc-*: one mesh of 4 simulated CPU devices, in 1 "
             "process or in 2 processes of 2 (gloo collectives); process_bytes is what a "
             "process's devices hold, peak_over_baseline_bytes the largest of its processes' "
             "peaks (each one in *_each_process). On data=2,model=2 each process holds "
             "every model shard, so the whole model."),
    (("transformers",), "transformers leaves bfloat16 weights as pages of the memory-mapped "
                        "files, read on first use: its load peak and time exclude reading "
                        "them; *_after_reading_weights adds reading one value per page of "
                        "every weight."),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=14, help="decoder layers (14: about 0.6 GB)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help=f"comma-separated of {MODES}, or multiprocess (the modes "
                         f"{', '.join(MULTIPROCESS_MODES)})")
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes per mode")
    ap.add_argument("--out", type=Path, help="write the report here (JSON)")
    args = ap.parse_args()
    modes = MULTIPROCESS_MODES if args.modes == "multiprocess" else args.modes.split(",")
    for mode in modes:
        if mode not in MODES:
            ap.error(f"mode {mode!r} is not one of {MODES}")
    from specjax import bench

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        nbytes = write_checkout(Path(tmp), args.layers, args.shards)
        print(f"checkout: {nbytes / 1e9:.3f} GB in {args.shards} shards", file=sys.stderr)
        runs = {}
        for mode in modes:
            runs[mode] = summarize([measure(Path(tmp), mode) for _ in range(args.repeat)],
                                   nbytes)
            print(f"{mode}: peak {runs[mode]['peak_over_file_bytes']}x file bytes "
                  f"(largest of its processes), {runs[mode]['wall_s']} s", file=sys.stderr)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *LOADER_FILES],
                           cwd=ROOT).returncode != 0
    report = {"command": "python scripts/load_bench.py " + " ".join(sys.argv[1:]),
              "git_commit": commit, "uncommitted_loader_changes": dirty,
              "machine": f"{os.cpu_count()}-core CPU", "machine_details": bench.machine_info(),
              "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "checkout": {"config": hf_config(args.layers), "shards": args.shards,
                           "file_bytes": nbytes, "dtype": "bfloat16"},
              "setups": {m: dict(zip(("processes", "devices_per_process", "mesh_data_model",
                                      "scan_layers"), SETUPS[m])) for m in modes if m in SETUPS},
              "note": " ".join(n for ms, n in NOTES if not ms or set(ms) & set(modes)),
              "runs": runs}
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
