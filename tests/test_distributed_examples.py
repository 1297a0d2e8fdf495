"""The three multi-process examples (docs/distributed.md) run as the docs launch them:
``torchrun --nproc-per-node 2``, gloo on the CPU, and their models train."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4

pytestmark = [pytest.mark.slow,  # two processes per example, each importing torch
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="needs torch.distributed with gloo")]


def run_example(name: str) -> str:
    """stdout of ``python -m torch.distributed.run --nproc-per-node 2 examples/<name>.py``
    on the CPU (no GPU visible, so the examples choose gloo)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "examples" / f"{name}.py"), "--steps", str(STEPS)],
        capture_output=True, text=True, env=env, timeout=240, check=False)
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def losses(stdout: str) -> list[float]:
    return [float(m) for m in re.findall(r"^step\s+\d+\s+loss\s+([0-9.]+)$", stdout, flags=re.M)]


@pytest.mark.parametrize("name", ["ddp_dit", "fsdp2_llama", "tp_sp_llama"])
def test_example_trains_on_two_processes(name):
    stdout = run_example(name)
    got = losses(stdout)
    assert len(got) == STEPS, stdout  # rank 0 prints one line per step
    assert got[-1] < got[0], got
    if name == "tp_sp_llama":  # the norms keep the sequence sharding: half the tokens per rank
        assert "returns a DTensor (Shard(dim=1),), local (8, 16, 64) of (8, 32, 64)" in stdout, stdout
