"""One process of a multi-process decode (``tests/test_multiprocess.py``): joins the run,
builds the toy Llama of ``test_conformance`` on each mesh given, decodes the ragged batch
with each method spec (random heads from one key, as the conformance test builds them) and
prints one ``RESULT {json}`` line: per mesh and spec, the tokens, lengths and statistics
this process got back, and the decode program's host transfers (per round, in the whole module).

    python tests/mp_decode.py COORDINATOR N I '{"data=2,model=2": ["ar", ...], ...}'
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specjax import distributed


def main(coordinator: str, n: int, i: int, plan: dict) -> None:
    distributed.initialize(distributed.Settings(coordinator, n, i, timeout=60))
    import jax
    import numpy as np

    sys.path.insert(0, str(Path(__file__).parent))
    import toys
    from toys import BUDGETS, OPTIONS, PROMPTS
    from specjax import hlo, methods, sharding
    from specjax.core import decoder

    model, params = toys.llama(seed=1)
    out = {"process": jax.process_index(), "devices": jax.device_count(),
           "local": jax.local_device_count()}
    for spec_text, specs in plan.items():
        mesh = sharding.mesh_from_spec(spec_text)
        lm = toys.ToyLM(model, sharding.shard_params(model.config, params, mesh), eos_ids=(),
                        mesh=mesh)
        for spec in specs:
            b = methods.parse(spec).random(lm, OPTIONS, jax.random.key(3))
            o = b(PROMPTS, max_new_tokens=BUDGETS)
            exe = list(decoder._RUN._exes.values())[-1]  # the program this call ran
            stats = hlo.hlo_stats(exe.as_text())
            out[f"{spec_text}|{spec}"] = {
                "host_transfers": [stats["round"]["host_transfers"],
                                   stats["host_transfers_in_module"]],
                "tokens": o.to_lists(), "lengths": np.asarray(o.lengths).tolist(),
                "forwards": np.asarray(o.target_forwards).tolist(), "tau": o.tau,
                "accepted": np.asarray(o.accepted).tolist()}
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
