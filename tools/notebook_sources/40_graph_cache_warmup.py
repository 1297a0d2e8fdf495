# %% [markdown]
# # 40 · Graph cache and warmup: record → warm up → fast start
#
# Every distinct configuration (op, phase, shape, dtypes, device) is its own cuDNN graph,
# and building one costs 0.1–1.4 s on an H200 (most of it plan finalisation). A training
# step with a few norm shapes therefore spends seconds building graphs before its first
# result, and again in every new process. cudnorm keeps built plans in two places:
#
# | where | lifetime | counted by |
# |---|---|---|
# | in-memory LRU cache | the process | `cudnorm.cache_info()` |
# | on-disk plan store (serialized plans, 34–98 KB each) | across processes, per GPU + library versions | `cudnorm.plan_store_info()` |
#
# Loading a stored plan takes milliseconds instead of a build. The workflow:
#
# 1. **record** the graphs one real step asks for: `with cudnorm.record_specs("step.json"): ...`
# 2. **warm up** ahead of the job (e.g. while the container starts): `cudnorm warmup step.json`
# 3. **fast start**: the job's first step loads every graph from the store.
#
# On a machine without a GPU nothing is built or stored; the notebook still runs and
# shows the (empty) counters.

# %%
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# a private plan store for this notebook, set before cudnorm is imported: the variable seeds
# cudnorm's configuration (`cudnorm.config(plan_store_dir=...)` would change this process
# only), and the fresh processes started below inherit it
workdir = Path(tempfile.mkdtemp(prefix="cudnorm-warmup-"))
os.environ["CUDNORM_PLAN_STORE_DIR"] = str(workdir / "plans")

import torch

import cudnorm

device = "cuda" if torch.cuda.is_available() else "cpu"
print(device, cudnorm.plan_store_info())

# %% [markdown]
# ## The job
#
# A stand-in for a training job: one step of LayerNorm → RMSNorm on bf16 activations with
# fp32 weights, checked against PyTorch. It lives in a file so that it can also run as a
# fresh process, which is where start-up time matters. The tolerance allows two bf16
# rounding steps ($2 \cdot 2^{-7} \approx 1.6\cdot10^{-2}$) per norm, since the second
# norm sees the first one's rounding.

# %%
JOB = '''
"""One training step of LayerNorm -> RMSNorm; run as a script it prints its first-step time."""
import json
import sys
import time

import torch
import torch.nn.functional as F

import cudnorm


def step(device, tokens=2048, dim=1024):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=g).to(device, torch.bfloat16).requires_grad_()
    ln, rms = cudnorm.LayerNorm(dim).to(device), cudnorm.RMSNorm(dim).to(device)
    out = rms(ln(x))
    out.float().square().mean().backward()
    with torch.no_grad():
        inferred = rms(ln(x))
        lw, lb, rw = (p.to(x.dtype) for p in (ln.weight, ln.bias, rms.weight))
        expected = F.rms_norm(F.layer_norm(x, (dim,), lw, lb), (dim,), rw)
    torch.testing.assert_close(out, expected, atol=3.2e-2, rtol=3.2e-2)
    torch.testing.assert_close(inferred, expected, atol=3.2e-2, rtol=3.2e-2)


if __name__ == "__main__":
    device = sys.argv[1]
    start = time.perf_counter()
    step(device)
    if device == "cuda":
        torch.cuda.synchronize()
    print(json.dumps({"first_step_s": round(time.perf_counter() - start, 3), **vars(cudnorm.cache_info())}))
'''
(workdir / "job.py").write_text(JOB)
sys.path.insert(0, str(workdir))
import job  # noqa: E402


def run_job_in_new_process():
    done = subprocess.run([sys.executable, str(workdir / "job.py"), device], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.splitlines()[-1])


def cudnorm_cli(*args):
    """``cudnorm <args>`` in a new process (``python -m cudnorm.cli`` is the same command)."""
    done = subprocess.run([sys.executable, "-m", "cudnorm.cli", *args], capture_output=True, text=True, check=True)
    print(done.stdout)

# %% [markdown]
# ## 1. Record
#
# Run one real step inside `record_specs`. Every graph the ops ask for is noted and, when
# the block exits, written to a spec file. (Recording also builds the graphs in this
# process, as any first step does; on the CPU no graph is asked for and `record_specs`
# warns about exactly that.)

# %%
spec_file = workdir / "step.json"
with cudnorm.record_specs(spec_file) as recording:
    job.step(device)
print(f"{len(recording.specs)} graph(s) recorded")
for spec in recording.specs:
    print(" ", spec.slug())

# %% [markdown]
# ## 2. Warm up ahead of the job
#
# Start from an empty store (as on a fresh machine), then build the recorded graphs with
# the command line tool. Each built plan is saved to the store.

# %%
cudnorm.clear_plan_store()
cold = run_job_in_new_process()  # a first step with nothing stored: it builds every graph
cudnorm.clear_plan_store()
cudnorm_cli("warmup", str(spec_file), "--no-progress")
cudnorm_cli("cache", "info")

# %% [markdown]
# ## 3. Fast start
#
# A new process runs the same step; its graphs now come from the store (`store_loads`)
# instead of being built (`builds`). The job's own `assert_close` checks that plans loaded
# from disk compute what PyTorch computes.

# %%
warm = run_job_in_new_process()
for name, result in (("cold start", cold), ("after warmup", warm)):
    print(f"{name:<13} first step {result['first_step_s']:7.3f} s   builds {result['builds']}   "
          f"store loads {result['store_loads']}   build seconds {result['build_seconds']:.2f}")

# %% [markdown]
# ## Check
#
# After warmup the job builds nothing: every graph it needs was recorded and stored. On a
# GPU that means the cold start built every recorded graph and the warm start loaded those its
# calls run (a call whose measured decision, stored beside the plans, is PyTorch's op or
# cudnorm's own kernel loads none); on the CPU both counts are zero.

# %%
assert warm["builds"] == 0, warm
assert cold["builds"] + cold["store_loads"] == len(recording.specs), (cold, len(recording.specs))
assert warm["store_loads"] <= len(recording.specs), (warm, len(recording.specs))
print(f"warm start built nothing; it loaded {warm['store_loads']} of the {len(recording.specs)} recorded "
      "graph(s) from the store")

# %%
import shutil  # noqa: E402

shutil.rmtree(workdir)  # the notebook's private plan store and spec file
