"""examples/train_gpt.py, the main demo: the ModuleList GPT under torchrun on 2 ranks, cut between blocks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = {"steps": 6, "microbatches": 4, "microbatch-size": 2, "seq": 16, "layers": 4, "width": 32}


def _reference() -> list[float]:
    """The demo's model, optimiser and batches trained by a plain torch loop in one process."""
    sys.path.insert(0, ROOT)
    from examples.gpt_model import GPT, lm_loss
    from examples.train_gpt import batches, corpus

    torch.manual_seed(0)
    model = GPT(vocab=256, width=SMALL["width"], layers=SMALL["layers"], heads=4, seq=SMALL["seq"])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    out = []
    for ids, targets in batches(corpus(), SMALL["steps"], SMALL["microbatches"] * SMALL["microbatch-size"],
                                SMALL["seq"], seed=0):
        opt.zero_grad()
        loss = lm_loss(model(ids), targets)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def test_demo_partitions_the_modulelist_gpt_between_blocks_and_matches_one_process(tmp_path: Any) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", "2",
           "examples/train_gpt.py", "--out", str(tmp_path)]
    cmd += [a for key, value in SMALL.items() for a in (f"--{key}", str(value))]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    log = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    ranks = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(embed|blocks\.\S+|head)\s.*?\s+(\d)\s", log, re.M)}
    assert ranks.get("embed") == 0 and ranks.get("head") == 1, log
    assert {r for name, r in ranks.items() if name.startswith("blocks.")} == {0, 1}, log
    assert sorted(os.listdir(tmp_path)) == ["loss.svg", "losses.json", "plan.svg", "timeline.svg",
                                            "timeline.trace.json"]
    with open(tmp_path / "losses.json") as f:
        losses = json.load(f)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_reference()), rtol=1e-4, atol=1e-5)
    assert losses[-1] < losses[0], losses
