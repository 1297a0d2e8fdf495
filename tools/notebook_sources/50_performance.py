# %% [markdown]
# # 50 · Performance: the benchmark table and plot
#
# A normalisation reads its input once and writes its output once; at the sizes of real
# models it is limited by memory bandwidth, not arithmetic. `cudnorm bench` therefore
# reports throughput as
#
# $$\text{GB/s} = \frac{\text{bytes read} + \text{bytes written}}{\text{median time}}$$
#
# counting each input and output exactly once (the same byte count for every provider, so
# GB/s ratios are speed ratios), next to the measured device-to-device copy bandwidth, the
# practical ceiling. Before any provider is timed, its output and gradients are checked
# against an fp64 reference: its error must be at most twice eager PyTorch's in the same
# dtype, or it is reported as wrong and not timed.
#
# This notebook runs the quick benchmark (two small shapes per op, any device), checks its
# results, and shows the full GPU results committed in `benchmarks/results/`.

# %%
import csv
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from IPython.display import Image, Markdown, display

device = "cuda" if torch.cuda.is_available() else "cpu"
out = Path(tempfile.mkdtemp(prefix="cudnorm-bench-"))  # keep the checkout clean
print(device, "->", out)

# %% [markdown]
# ## Run `cudnorm bench --quick`
#
# On the CPU every provider runs PyTorch code, so the numbers say nothing about cuDNN;
# the run still exercises the whole pipeline: checks, timing, CSV, table and plot.

# %%
done = subprocess.run([sys.executable, "-m", "cudnorm.cli", "bench", "--quick", "--out", str(out)],
                      capture_output=True, text=True)
print(done.stdout[done.stdout.find("Legend:"):])
print(done.stderr[-2000:] if done.returncode else "", end="")
if (out / "bench.png").exists():
    display(Image(filename=str(out / "bench.png")))

# %% [markdown]
# ## Check against PyTorch
#
# Every cudnorm row must have passed its accuracy check (relative error against the fp64
# reference at most twice eager PyTorch's, or the dtype's floor), and so must eager PyTorch
# itself, the baseline of that rule.

# %%
with open(out / "bench.csv") as f:
    rows = list(csv.DictReader(f))
for provider in ("cudnorm", "torch"):
    mine = [r for r in rows if r["provider"] == provider]
    assert mine, f"no {provider} rows"
    bad = [(r["op"], r["shape"], r["status"]) for r in mine if r["status"] != "ok"]
    assert not bad, bad
    assert all(float(r["error"]) <= float(r["bound"]) for r in mine)
    print(f"{provider}: {len(mine)} op/shape cases, all within their error bound")
assert done.returncode == 0, done.returncode

# %% [markdown]
# ## Committed GPU results
#
# The full benchmark (`cudnorm bench --out benchmarks/results/<gpu-name>` on a GPU, about eight
# minutes) writes `bench.csv`, `bench.png`, `bench_speedup.png` and `summary.md` there. The results
# committed with this version are shown below; the performance page of the docs shows the
# same files.

# %%
results = Path.cwd().parent / "benchmarks" / "results"
# GB/s against N (bench), cudnorm against PyTorch per op (*_speedup), whole model steps
# (models) and host time per call (host_overhead): each a ratio around 1.0 with the run's noise band
plots = ("bench", "bench_speedup", "ops_speedup", "models", "host_overhead")
committed = sorted(p for p in results.glob("*/*.png") if p.stem in plots)
if not committed:
    print(f"No GPU results are committed in {results} yet: run `cudnorm bench` on a GPU to make them.")
for png in committed:
    display(Markdown(f"### {png.parent.name}: {png.name}"))
    display(Image(filename=str(png)))

# %% [markdown]
# ## Variable row counts: build time against steady state
#
# `benchmarks/variable_rows.py` runs one LayerNorm training step (N = 4096) for each of 100
# random row counts: with an exact graph per count (`exact`), with the defaults (the first
# count exact, later ones on shared chunk graphs: `chunked`) and with chunk graphs only
# (`cudnorm.config(exact_rows=0)`: `chunks`). Chunking builds 5-7 graphs instead of 200; the price
# is a slower steady state, because each chunk is one more launch and these calls are
# host-bound (see the docs, Concepts, "Variable row counts").

# %%
import matplotlib.pyplot as plt  # noqa: E402

for path in sorted(results.glob("*/variable_rows.csv")):
    with open(path) as f:
        modes = list(csv.DictReader(f))
    names = [m["mode"] for m in modes]
    fig, (build, steady) = plt.subplots(1, 2, figsize=(9, 3.2))
    bars = build.bar(names, [float(m["build_s"]) for m in modes], color="tab:blue")
    build.bar_label(bars, labels=[f"{m['builds']} graphs" for m in modes])
    build.set_yscale("log")
    build.set_ylim(0.3, 4 * max(float(m["build_s"]) for m in modes))
    build.set_ylabel("seconds building (log)")
    bars = steady.bar(names, [float(m["steady_ms"]) for m in modes], color="tab:orange")
    steady.bar_label(bars, fmt="%.0f ms")
    steady.set_ylim(0, 1.2 * max(float(m["steady_ms"]) for m in modes))
    steady.set_ylabel("ms per pass over the 100 steps")
    fig.suptitle(f"{path.parent.name}: 100 row counts in [1, 65536], LayerNorm training step, N = 4096")
    fig.tight_layout()
    plt.show()

# %%
import shutil  # noqa: E402

shutil.rmtree(out)  # the quick run's CSV, plot and summary
