"""``cudnorm bench --models --profile-host``: where a patched model step spends its host time.

For each case and provider, after the case is timed:

* one step under cProfile into ``<case>__<provider>.txt``: the 30 Python functions with the most
  own time, and the native path's table counters over the step (``resolved`` > 0: a call
  signature went back to Python);
* :data:`OP_STEPS` steps under ``torch.profiler`` (host activity only): each op's and each
  autograd node's own host time per step. ``<case>__ops.txt`` sets every provider's table
  against PyTorch's (``torch``), the ops and backward nodes whose host time grew or shrank the
  most first. A patched norm whose backward node costs more host time than PyTorch's shows
  there, which cProfile cannot see (autograd runs in C++; docs/performance.md, "Host-bound steps
  and the affine fold").
"""

from __future__ import annotations

import cProfile
import io
import pstats
from pathlib import Path

import torch

# steps per provider under torch.profiler: the profiler's own overhead varies from step to step
OP_STEPS = 3
# rows of each provider's difference: the largest increases, then a third as many decreases
ROWS = 24


def profile(case, live: dict, out: Path, device: str) -> None:
    """Write the cProfile of each provider's step and, with a ``torch`` provider, ``<case>__ops.txt``
    (``live``: provider -> its workload, whose ``step()`` runs one step)."""
    out.mkdir(parents=True, exist_ok=True)
    tables = {}
    for provider, workload in live.items():
        (out / f"{_file_name(case.id)}__{provider}.txt").write_text(_cprofile(case.id, provider, workload, device))
        tables[provider] = op_times(workload, device)
    if "torch" in tables and len(tables) > 1:
        (out / f"{_file_name(case.id)}__ops.txt").write_text(difference(case.id, tables))


def _file_name(case_id: str) -> str:
    return case_id.replace(":", "_").replace("/", "_")


def _cprofile(case_id: str, provider: str, workload, device: str) -> str:
    from .. import _native  # noqa: PLC0415 - the native path's module, only for its counters

    _sync(device)
    before = _native.counters()
    profiler = cProfile.Profile()
    profiler.enable()
    workload.step()
    _sync(device)
    profiler.disable()
    after = _native.counters()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    counters = {k: after[k] - before.get(k, 0) for k in after}
    return f"{case_id} {provider}: native table counters over the step {counters}\n" + text.getvalue()


def op_times(workload, device: str, steps: int = OP_STEPS) -> dict[str, tuple[float, float]]:
    """``{op or autograd node: (own host us per step, calls per step)}`` over ``steps`` steps."""
    from torch.profiler import ProfilerActivity  # noqa: PLC0415 - only this option profiles
    from torch.profiler import profile as torch_profile  # noqa: PLC0415

    _sync(device)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            workload.step()
        _sync(device)
    return {e.key: (e.self_cpu_time_total / steps, e.count / steps) for e in prof.key_averages()}


def difference(case_id: str, tables: dict[str, dict[str, tuple[float, float]]], rows: int = ROWS) -> str:
    """Each provider's :func:`op_times` against ``tables["torch"]``: the total, then per op the
    change of own host time and of calls per step, largest increases first, then the largest
    decreases."""
    base = tables["torch"]
    lines = []
    for provider, table in tables.items():
        if provider == "torch":
            continue
        changes = sorted(((table.get(k, (0.0, 0.0))[0] - base.get(k, (0.0, 0.0))[0],
                           table.get(k, (0.0, 0.0))[1] - base.get(k, (0.0, 0.0))[1], k) for k in set(base) | set(table)),
                         reverse=True)
        total = sum(us for us, _ in table.values()) - sum(us for us, _ in base.values())
        shown = changes[:rows] + [c for c in changes[-(rows // 3):] if c not in changes[:rows]]
        lines.append(f"{case_id}: {provider} against torch, own host time per step under torch.profiler "
                     f"(its overhead included): {total / 1e3:+.2f} ms")
        lines.append(f"{'us/step':>10} {'calls/step':>11}  op or autograd node")
        lines += [f"{us:+10.1f} {calls:+11.1f}  {key}" for us, calls, key in shown]
        lines.append("")
    return "\n".join(lines)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
