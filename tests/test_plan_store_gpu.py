"""The on-disk plan store with real cuDNN plans: a plan built in one process is loaded by a
fresh process (builds none) and gives bit-identical results. How fast that first call is
belongs to a benchmark, not a test: ``benchmarks/plan_store_startup.py``.

Each run is a new interpreter with its own ``CUDNORM_PLAN_STORE_DIR``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
import torch
import cudnorm
from cudnorm import _cache

out_dir = sys.argv[1]
dev = torch.device("cuda", 0)
gen = torch.Generator().manual_seed(0)
tensors = {}

def leaf(*shape, dtype):
    return torch.randn(*shape, generator=gen).to(dev, dtype).requires_grad_()

for m, n in ((4096, 1024), (1000, 4096)):
    x = leaf(m, n, dtype=torch.bfloat16)
    w, b = leaf(n, dtype=torch.float32), leaf(n, dtype=torch.float32)
    dy = torch.randn(m, n, generator=gen).to(dev, torch.bfloat16)
    y = cudnorm.layer_norm(x, (n,), w, b)
    y.backward(dy)
    tensors.update({f"ln_y_{m}": y, f"ln_dx_{m}": x.grad, f"ln_dw_{m}": w.grad, f"ln_db_{m}": b.grad})
    x.grad = w.grad = None
    y = cudnorm.rms_norm(x, (n,), w, 1e-6)
    y.backward(dy)
    tensors.update({f"rms_y_{m}": y, f"rms_dx_{m}": x.grad, f"rms_dw_{m}": w.grad})
    with torch.no_grad():
        tensors[f"rms_infer_{m}"] = cudnorm.rms_norm(x, (n,), w, 1e-6)
torch.save({k: v.detach().cpu() for k, v in tensors.items()}, f"{out_dir}/tensors.pt")
plans = {s.slug(): {"plan": p.plan_name, "candidates": p.candidates_timed, "source": p.source}
         for s in _cache.plans.specs() for p in [_cache.plans.lookup(s)]}
info = cudnorm.cache_info()
json.dump({"plans": plans, "builds": info.builds, "store_loads": info.store_loads},
          open(f"{out_dir}/report.json", "w"), indent=1)
"""


def _run(store: Path, out: Path, **env) -> dict:
    out.mkdir()
    # policy "cudnn": every call runs its cuDNN plan (under "auto" a process that finds a stored
    # decision for PyTorch's op or cudnorm's kernel loads no plan for that call)
    environ = {**os.environ, "CUDNORM_PLAN_STORE_DIR": str(store), "CUDNORM_POLICY": "cudnn",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), **env}
    environ.pop("CUDNORM_PLAN_STORE", None)
    proc = subprocess.run([sys.executable, "-W", "always::RuntimeWarning", "-c", CHILD, str(out)], env=environ,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    report["tensors"] = torch.load(out / "tensors.pt")
    report["stderr"] = proc.stderr
    return report


@pytest.mark.parametrize("autotune", ["0", "1"])
def test_plan_built_in_one_process_loads_in_another(tmp_path, autotune):
    store = tmp_path / "plans"
    cold = _run(store, tmp_path / "cold", CUDNORM_AUTOTUNE=autotune)
    graphs = len(cold["plans"])
    assert graphs == 10 and cold["builds"] == graphs and cold["store_loads"] == 0
    assert len(list(store.rglob("*.plan"))) == graphs

    warm = _run(store, tmp_path / "warm", CUDNORM_AUTOTUNE=autotune)
    assert warm["builds"] == 0 and warm["store_loads"] == graphs
    assert {k: v["source"] for k, v in warm["plans"].items()} == {k: "store" for k in cold["plans"]}
    # the stored choice is the built one, autotuned or not
    assert {k: (v["plan"], v["candidates"]) for k, v in warm["plans"].items()} == \
           {k: (v["plan"], v["candidates"]) for k, v in cold["plans"].items()}
    if autotune == "1":
        assert any(v["candidates"] > 1 for v in warm["plans"].values())
    for name, tensor in cold["tensors"].items():
        assert torch.equal(tensor, warm["tensors"][name]), name


def test_corrupt_entry_is_rebuilt_with_a_warning(tmp_path):
    store = tmp_path / "plans"
    cold = _run(store, tmp_path / "cold", CUDNORM_AUTOTUNE="0")
    victim = sorted(store.rglob("*.plan"))[0]
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    again = _run(store, tmp_path / "again", CUDNORM_AUTOTUNE="0")
    assert "checksum mismatch" in again["stderr"] and str(victim) in again["stderr"]
    assert again["builds"] == 1 and again["store_loads"] == len(cold["plans"]) - 1
    for name, tensor in cold["tensors"].items():
        assert torch.equal(tensor, again["tensors"][name]), name
    third = _run(store, tmp_path / "third", CUDNORM_AUTOTUNE="0")
    assert third["builds"] == 0 and "cudnorm plan store" not in third["stderr"]
