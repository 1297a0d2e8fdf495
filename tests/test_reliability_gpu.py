"""Reliability on the GPU: wrong arguments on CUDA tensors, threads and streams, thousands of
distinct shapes in bounded memory, the plan store under concurrent processes and across
library versions. Every call takes cudnorm's own path (``policy="cudnn"``, conftest)."""

import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import cudnorm
from cudnorm import _plan_store

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parents[1]


def _cuda(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


X = None if not torch.cuda.is_available() else _cuda(4, 64)
BAD_CALLS = [
    (lambda: cudnorm.layer_norm(X, (64,), torch.ones(64)), ValueError, "'weight' is on cpu but input is on cuda:0"),
    (lambda: cudnorm.layer_norm(X, (64,), torch.ones(64, device="meta")), ValueError, "'weight' is on meta"),
    (lambda: cudnorm.layer_norm(X, (64,), _cuda(64, dtype=torch.float16)), TypeError, "'weight' has dtype"),
    (lambda: cudnorm.layer_norm(X, (32,)), ValueError, "'normalized_shape'"),
    (lambda: cudnorm.rms_norm(X, (64,), None, -1.0), ValueError, "'eps'"),
    (lambda: cudnorm.rms_norm(X, (64,), [1.0] * 64), TypeError, "'weight'"),
    (lambda: cudnorm.rms_norm(X.to(torch.int32), (64,)), TypeError, "'input' has dtype"),
    (lambda: cudnorm.ada_layer_norm(X.view(4, 1, 64), _cuda(2, 64), _cuda(4, 64)), ValueError, "'scale' has shape"),
    (lambda: cudnorm.ada_layer_norm(X.view(4, 1, 64), _cuda(4, 64), torch.zeros(4, 64, dtype=torch.bfloat16)),
     ValueError, "'shift' is on cpu"),
]


@pytest.mark.parametrize("side_stream", [False, True], ids=["default_stream", "side_stream"])
@pytest.mark.parametrize("call, error, words", BAD_CALLS)
def test_wrong_arguments_on_cuda_tensors(call, error, words, side_stream):
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream), pytest.raises(error, match=words.replace("(", r"\(").replace("[", r"\[")):
        call()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensors_on_two_devices_are_refused():
    with pytest.raises(ValueError, match="'weight' is on cuda:1 but input is on cuda:0"):
        cudnorm.layer_norm(X, (64,), torch.ones(64, device="cuda:1", dtype=X.dtype))


def _workload(seed: int):
    """LN, RMS and AdaLN forward+backward on a few shapes; returns every output and gradient."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for m, n in ((256, 1024), (100, 4096), (33, 768)):
        x = torch.randn(m, n, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, device="cuda", generator=g, requires_grad=True)
        s, t = (torch.randn(4, n, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        dy = torch.randn(m, n, device="cuda", generator=g, dtype=torch.bfloat16)
        for y, leaves in ((cudnorm.layer_norm(x, (n,), w, w), (x, w)), (cudnorm.rms_norm(x, (n,), w, 1e-6), (x, w)),
                          (cudnorm.ada_layer_norm(x[:m // 4 * 4].view(4, -1, n), s, t, one_plus_scale=True),
                           (x, s, t))):
            grads = torch.autograd.grad(y, leaves, dy[:y.numel() // n].view(y.shape))
            out += [y.detach(), *grads]
    return out


def test_threads_and_streams_match_serial_bit_for_bit():
    """8 threads, each alternating between two streams of its own, 5 rounds each: every output
    and gradient equals the serial run's bit for bit (per-thread handles bound to the current
    stream, workspaces and plans shared safely)."""
    serial = {seed: [t.clone() for t in _workload(seed)] for seed in range(8)}
    torch.cuda.synchronize()
    failures, errors = [], []

    def worker(seed):
        try:
            streams = (torch.cuda.Stream(), torch.cuda.Stream())
            for round_ in range(5):
                stream = streams[round_ % 2]
                with torch.cuda.stream(stream):
                    got = _workload(seed)
                stream.synchronize()
                if not all(torch.equal(a, b) for a, b in zip(got, serial[seed])):
                    failures.append((seed, round_))
        except Exception as exc:  # noqa: BLE001 - reported below with the thread's seed
            errors.append((seed, repr(exc)))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not failures, (errors, failures)


def _gpu_used_bytes() -> int:
    """Device memory in use as the driver sees it: the CUDA context, cuDNN's plans and
    kernels, and torch's live tensors (its cached free blocks returned first)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


def _rss_bytes() -> int:
    """Resident host memory, after glibc returns its free heap pages (malloc_trim), so that
    what is measured is memory held, not the allocator's retention."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: measure as is
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.mark.alone  # the driver's figure counts every process on the GPU (failed beside 9 parallel parts)
def test_ten_thousand_shapes_keep_memory_bounded(fresh_cache):
    """10,000 distinct (rows, width) shapes, LN and RMS forward+backward with the default
    row-chunking policy (each width's first row count gets exact graphs, the others run
    shared chunk graphs) and a 16-plan cache, in two passes of 5,000 over the same widths
    with other row counts: the cache evicts and rebuilds, and neither GPU memory (as the
    driver reports it, torch's cached blocks returned) nor host memory grows from the first
    pass to the second, while results still match PyTorch.

    Found with it: the call-signature memos kept evicted plans alive (about 6 MiB of host
    memory each), so memory grew with every rebuild past the cache's capacity."""
    widths = (1024, 1536, 2048, 3072, 4096)
    marks = []
    # cache_size resizes the plan cache on entry and back on exit
    with cudnorm.config(cache_size=16, exact_rows=1, exact_after=1, autotune="off"):
        for first_rows in (1024, 1027):
            for n in widths:
                w = torch.randn(n, device="cuda", requires_grad=True)
                for j, m in enumerate(range(first_rows, first_rows + 7 * 1000, 7)):  # 1,000 row counts
                    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    y = (cudnorm.layer_norm if j % 2 else cudnorm.rms_norm)(x, (n,), w)
                    y.backward(torch.ones_like(y))
                    if j == 501:  # a chunked call against PyTorch
                        want = F.layer_norm(x.detach(), (n,), w.detach().bfloat16())
                        torch.testing.assert_close(y.detach(), want, rtol=2e-2, atol=2e-2)
            del x, y, w
            gc.collect()
            marks.append((_gpu_used_bytes(), _rss_bytes(), cudnorm.cache_info()))
    (gpu0, host0, info0), (gpu1, host1, info) = marks
    print(f"\n10,000 shapes: plans built {info0.builds} + {info.builds - info0.builds}, evicted {info.evictions}, "
          f"cache size {info.size}, chunked calls {info.chunked_calls}; after 5,000 / 10,000 shapes: "
          f"GPU used {gpu0 / 2**20:.0f} / {gpu1 / 2**20:.0f} MiB, host RSS {host0 / 2**20:.0f} / {host1 / 2**20:.0f} MiB, "
          f"torch peak allocated {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
    assert info.builds > info0.builds and info.evictions > 0 and info.size <= 16 and info.chunked_calls > 9000
    assert gpu1 - gpu0 < 64 * 2**20, gpu1 - gpu0
    assert host1 - host0 < 96 * 2**20, host1 - host0


CHILD = r"""
import json, sys
import torch
import cudnorm
from cudnorm import _runtime

out, fake_version = sys.argv[1], sys.argv[2]
if fake_version != "-":  # a store written by another cuDNN release
    real = _runtime.device_fingerprint
    _runtime.device_fingerprint = lambda index: {**real(index), "cudnn_backend": fake_version}
gen = torch.Generator().manual_seed(0)
results = {}
for m, n in ((4096, 1024), (1000, 2048), (64, 4096)):
    x = torch.randn(m, n, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    w = torch.randn(n, generator=gen).cuda().requires_grad_()
    for name, fn in (("ln", lambda: cudnorm.layer_norm(x, (n,), w, w)), ("rms", lambda: cudnorm.rms_norm(x, (n,), w))):
        y = fn()
        y.backward(torch.ones_like(y))
        results[f"{name}_{m}"] = [y.float().sum().item(), x.grad.float().sum().item(), w.grad.sum().item()]
        x.grad = w.grad = None
info = cudnorm.cache_info()
json.dump({"results": results, "builds": info.builds, "store_loads": info.store_loads}, open(out, "w"))
"""


def _spawn(store: Path, out: Path, fake_version: str = "-") -> subprocess.Popen:
    env = {**os.environ, "CUDNORM_PLAN_STORE_DIR": str(store), "CUDNORM_POLICY": "cudnn", "CUDNORM_AUTOTUNE": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("CUDNORM_PLAN_STORE", None)
    return subprocess.Popen([sys.executable, "-c", CHILD, str(out), fake_version], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, out: Path) -> dict:
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    report = json.loads(out.read_text())
    report["stderr"] = stderr
    return report


def test_plan_store_with_four_writers_and_another_version(tmp_path):
    """Four processes build and store the same plans at once: each finishes, the store holds
    one valid entry per plan, and a fifth process loads every plan and builds none, with the
    same results. A store written by another cuDNN release is ignored (its entries live under
    another fingerprint): that process builds everything, silently, and agrees."""
    store = tmp_path / "plans"
    writers = [(_spawn(store, tmp_path / f"w{i}.json"), tmp_path / f"w{i}.json") for i in range(4)]
    reports = [_finish(p, out) for p, out in writers]
    plans = reports[0]["builds"] + reports[0]["store_loads"]
    assert plans > 0 and all(r["builds"] + r["store_loads"] == plans for r in reports)
    assert len(list(store.rglob("*.plan"))) == plans and not [p for p in store.rglob("*") if p.name.startswith(_plan_store._TEMP_PREFIX)]
    assert all(r["results"] == reports[0]["results"] for r in reports)

    reader = _finish(_spawn(store, tmp_path / "r.json"), tmp_path / "r.json")
    assert reader["builds"] == 0 and reader["store_loads"] == plans and reader["results"] == reports[0]["results"]

    other = _finish(_spawn(store, tmp_path / "o.json", fake_version="1.0.0"), tmp_path / "o.json")
    assert other["builds"] == plans and other["store_loads"] == 0 and "plan store" not in other["stderr"]
    assert other["results"] == reports[0]["results"]
    assert len({p.parent for p in store.rglob("*.plan")}) == 2


def test_process_exit_is_quiet():
    """A process that ran plans on the main thread and on worker threads exits with nothing
    on stderr: cuDNN-frontend objects still alive at shutdown made the binding print
    "nanobind: leaked ..." lists (seen on an H100 after the threads test)."""
    child = ("import threading, torch, cudnorm\n"
             "def work():\n"
             "    x = torch.randn(64, 1024, device='cuda', dtype=torch.bfloat16, requires_grad=True)\n"
             "    w = torch.ones(1024, device='cuda', requires_grad=True)\n"
             "    cudnorm.layer_norm(x, (1024,), w, w).sum().backward()\n"
             "    cudnorm.ada_layer_norm(x.view(4, 16, 1024), w.expand(4, -1), w.expand(4, -1)).sum().backward()\n"
             "work()\n"
             "threads = [threading.Thread(target=work) for _ in range(4)]\n"
             "[t.start() for t in threads]; [t.join() for t in threads]\n")
    env = {**os.environ, "CUDNORM_POLICY": "cudnn", "CUDNORM_PLAN_STORE": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "leaked" not in done.stderr, done.stderr[-3000:]
