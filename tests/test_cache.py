"""The plan cache: keys, LRU order and bound, counters, declines, thread safety."""

import threading
import time

import pytest
import torch

import cudnorm
from cudnorm import _cache, _dispatch, _graphs
from cudnorm._spec import NormSpec


def _spec(rows=8, **kw):
    base = dict(op="layer_norm", phase="train", rows=rows, cols=64, x_dtype=torch.bfloat16,
                scale_dtype=torch.bfloat16, device_index=0)
    return NormSpec(**{**base, **kw})


def test_key_is_value_based_and_eps_free():
    assert _spec() == _spec() and hash(_spec()) == hash(_spec())
    distinct = {_spec(), _spec(rows=9), _spec(phase="infer"), _spec(x_dtype=torch.float16),
                _spec(scale_dtype=torch.float32), _spec(device_index=1), _spec(x_row_stride=128),
                _spec(autotune=True), _spec(op="rms_norm")}
    assert len(distinct) == 9
    assert "eps" not in NormSpec._fields
    assert _spec(x_row_stride=64) == _spec(), "packed rows have one canonical key"


def test_lru_evicts_least_recently_used_and_counts():
    cache = _cache.PlanCache(capacity=2)
    built = []
    build = lambda spec: built.append(spec) or f"plan{spec.rows}"  # noqa: E731
    assert cache.get_or_build(_spec(1), build) == "plan1"
    assert cache.get_or_build(_spec(2), build) == "plan2"
    assert cache.get_or_build(_spec(1), build) == "plan1"  # hit: 1 becomes most recent
    cache.get_or_build(_spec(3), build)  # evicts 2
    assert [s.rows for s in cache.specs()] == [1, 3]
    info = cache.info()
    assert (info.hits, info.misses, info.evictions, info.size) == (1, 3, 1, 2)
    assert [s.rows for s in built] == [1, 2, 3]
    cache.resize(1)
    assert [s.rows for s in cache.specs()] == [3]
    with pytest.raises(ValueError, match="capacity"):
        cache.resize(0)


def test_eviction_releases_the_plans_the_call_memos_hold():
    """A call-signature memo holding an evicted plan would keep the plan, and its host and GPU
    memory, alive past the cache's capacity; evictions (by a build or a resize) empty the memos."""
    from cudnorm import _call_plans

    cache = _cache.PlanCache(capacity=1)
    notified = []
    cache.on_evict(lambda: notified.append(1))
    cache.put(_spec(1), "plan1")
    assert not notified
    cache.put(_spec(2), "plan2")
    assert notified == [1]
    cache.resize(1)  # nothing to evict
    assert notified == [1]

    memo = _call_plans._norm_calls
    with cudnorm.config(cache_size=1):
        _cache.plans.put(_spec(7), "a")
        memo.put(("signature",), "a")
        assert memo.get(("signature",)) == "a"
        _cache.plans.put(_spec(8), "b")  # evicts "a"
        assert memo.get(("signature",)) is None
    cudnorm.clear_cache()


def test_concurrent_misses_build_once():
    cache = _cache.PlanCache(capacity=8)
    calls = []

    def slow_build(spec):
        calls.append(spec)
        time.sleep(0.05)
        return "plan"

    threads = [threading.Thread(target=cache.get_or_build, args=(_spec(), slow_build)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert cache.info().hits + cache.info().misses == 8


def test_declined_spec_is_remembered_and_counted(monkeypatch, fresh_cache):
    attempts = []

    def refuse(spec):
        attempts.append(spec)
        raise RuntimeError("no engine")

    monkeypatch.setattr(_graphs, "build_plan", refuse)
    with pytest.warns(RuntimeWarning, match="cuDNN declined"):
        assert _cache.get_plan(_spec()) is None
    assert _cache.get_plan(_spec()) is None
    assert len(attempts) == 1
    info = cudnorm.cache_info()
    assert info.declined == 1 and info.hits == 1


def test_builds_and_build_seconds_are_counted(monkeypatch, fresh_cache):
    class FakePlan:
        build_seconds = 0.25

    monkeypatch.setattr(_graphs, "build_plan", lambda spec: FakePlan())
    _cache.get_plan(_spec(1))
    _cache.get_plan(_spec(2))
    _cache.get_plan(_spec(1))
    info = cudnorm.cache_info()
    assert (info.builds, info.misses, info.hits) == (2, 2, 1)
    assert info.build_seconds == pytest.approx(0.5)
    cudnorm.clear_cache()
    assert cudnorm.cache_info().size == 0 and cudnorm.cache_info().builds == 0


def test_autotune_policies():
    cudnorm.config(autotune="auto")
    assert _dispatch.autotune_wanted("layer_norm", "train", 32768, 4096)
    assert not _dispatch.autotune_wanted("layer_norm", "train", 64, 4096)
    assert _dispatch.autotune_wanted("layer_norm", "bwd", 32768, 4096)  # the widths where tuning won
    assert _dispatch.autotune_wanted("layer_norm", "bwd", 32768, 8192)
    assert not _dispatch.autotune_wanted("layer_norm", "bwd", 32768, 1024)
    assert not _dispatch.autotune_wanted("layer_norm", "bwd", 32768, 16384)
    assert not _dispatch.autotune_wanted("layer_norm", "bwd", 64, 4096)  # too small to pay for tuning
    assert not _dispatch.autotune_wanted("rms_norm", "bwd", 32768, 4096)
    assert _dispatch.autotune_wanted("rms_norm", "train", 32768, 32768)  # 2**30 elements: tuned
    assert not _dispatch.autotune_wanted("rms_norm", "train", 16384, 131072)  # 2**31: tuning costs 36-103 s
    cudnorm.config(autotune="on")
    assert _dispatch.autotune_wanted("layer_norm", "bwd", 1, 1)
    cudnorm.config(autotune="off")
    assert not _dispatch.autotune_wanted("layer_norm", "train", 32768, 4096)


def test_forward_params_rounds_fp32_weights_for_half_inputs():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    w, b = torch.randn(8), torch.randn(8)
    scale, shift, dtype = _dispatch.forward_params(x, w, b, has_bias=True)
    assert dtype == torch.bfloat16 and scale.dtype == shift.dtype == torch.bfloat16
    cudnorm.config(fp32_weight_fwd="native")
    scale, shift, dtype = _dispatch.forward_params(x, w, None, has_bias=True)
    assert dtype == torch.float32 and scale is w, "no copy"
    assert torch.equal(shift, torch.zeros(8)), "an absent bias is a zeros vector"
    scale, _, _ = _dispatch.forward_params(x, None, None, has_bias=False)
    assert torch.equal(scale, torch.ones(8, dtype=torch.bfloat16))


def test_cudnn_rows_copies_only_when_needed():
    x = torch.randn(16, 64)
    assert _dispatch.cudnn_rows(x) is x
    # padded rows are copied: cuDNN 9.19 declines a graph whose x rows lie further apart than y's
    padded = torch.randn(16, 128)[:, :64]
    rows = _dispatch.cudnn_rows(padded)
    assert rows.stride() == (64, 1) and torch.equal(rows, padded)
    transposed = torch.randn(64, 16).t()
    assert _dispatch.cudnn_rows(transposed).is_contiguous()
    # one row of a wider buffer: a view with the packed row stride, no copy
    buffer = torch.randn(4, 128)
    one = _dispatch.cudnn_rows(buffer[2:3, :64])
    assert one.stride() == (64, 1) and one.data_ptr() == buffer[2].data_ptr() and torch.equal(one, buffer[2:3, :64])


class _Candidates:
    """A graph with ``count`` candidate plans, as far as autotuning asks; candidate ``special``
    carries the name of a plan in ``EXTRA_CANDIDATES``."""

    def __init__(self, count, special=None):
        self.count, self.special = count, special

    def get_execution_plan_count(self):
        return self.count

    def get_plan_name_at_index(self, index):
        from cudnorm import _graphs

        return _graphs.EXTRA_CANDIDATES[0] if index == self.special else f"eng5_k{index}"


def test_autotune_candidates():
    from cudnorm import _graphs

    assert _graphs.autotune_candidates(_Candidates(27)) == list(range(8))  # the default
    assert _graphs.autotune_candidates(_Candidates(3)) == list(range(3))
    assert _graphs.autotune_candidates(_Candidates(27, special=21)) == [*range(8), 21]  # a known fast plan
    assert _graphs.autotune_candidates(_Candidates(27, special=5)) == list(range(8))  # already among them
    cudnorm.config(autotune_candidates="all")
    assert _graphs.autotune_candidates(_Candidates(27, special=21)) == list(range(27))
    cudnorm.config(autotune_candidates=12)
    assert _graphs.autotune_candidates(_Candidates(27)) == list(range(12))


# -- the one cache abstraction: cudnorm._lru ------------------------------------------------
def test_lru_bounds_orders_and_counts():
    from cudnorm import _lru

    evicted = []
    lru = _lru.LRU("test-private", 2, lambda: evicted.append(1), register=False)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # "a" is now the most recent
    lru.put("c", 3)  # evicts "b"
    assert lru.keys() == ["a", "c"] and lru.get("b") is None and evicted == [1]
    assert lru.stats() == _lru.LRUStats(size=2, capacity=2, hits=1, misses=1, evictions=1)
    lru.resize(1)
    assert lru.keys() == ["c"] and lru.stats().evictions == 2
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        lru.resize(0)
    assert "test-private" not in _lru.registry()


def test_lru_never_holds_more_than_capacity_between_steps():
    """A lock-free reader (``len``, ``get``) may look at any moment of a ``put``: the map is
    watched after every insertion, and a new key must have evicted before it went in."""
    from collections import OrderedDict

    from cudnorm import _lru

    class Watched(OrderedDict):
        largest = 0

        def __setitem__(self, key, value):
            super().__setitem__(key, value)
            Watched.largest = max(Watched.largest, len(self))

    lru = _lru.LRU("test-watched", 4, register=False)
    lru._data = Watched()
    for key in range(10):
        lru.put(key, key)
    lru.put(9, "again")  # an existing key evicts nothing
    assert Watched.largest == 4
    assert lru.keys() == [6, 7, 8, 9] and lru.stats().evictions == 6


def test_lru_is_safe_under_threads():
    """8 threads reading and writing one small LRU: no error, never above capacity."""
    from cudnorm import _lru

    lru = _lru.LRU("test-threads", 16, register=False)
    errors, sizes = [], []

    def work(seed):
        try:
            for i in range(5000):
                key = (seed * 7 + i) % 40
                if lru.get(key) is None:
                    lru.put(key, i)
                if i % 97 == 0:
                    lru.pop(key)
                sizes.append(len(lru))
        except Exception as exc:  # the test reports it below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and max(sizes) <= 16


def test_every_module_level_cache_is_registered_and_cleared():
    """No module of the package keeps a cache of its own: a module-level empty dict/set is
    a cache outside the registry (clear_cache() would not see it). Every registered cache is
    reported by cache_info() and emptied by clear_cache()."""
    import ast
    import pathlib

    from cudnorm import _lru

    root = pathlib.Path(cudnorm.__file__).parent
    allowed = {("_lru.py", "_REGISTRY"), ("providers.py", "_compiled")}  # the registry; bench-only
    found = []
    for path in root.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            value = getattr(node, "value", None)
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            empty = (isinstance(value, ast.Dict) and not value.keys) or (
                isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", ""))
                in ("dict", "set", "OrderedDict") and not value.args and not value.keywords)
            if empty and (path.name, getattr(target, "id", "")) not in allowed:
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, f"module-level caches outside cudnorm._lru: {found}"
    names = set(_lru.registry())
    assert {"plans", "norm_calls", "ada_forward_calls", "ada_backward_calls", "row_counts",
            "exact_row_families", "constant_vectors", "host_scalars", "kernel_caches", "routes"} <= names
    assert set(cudnorm.cache_info().caches) == names
    for cache in _lru.registry().values():
        cache.put(("test-key",), "value")
    cudnorm.clear_cache()
    assert all(len(cache) == 0 for cache in _lru.registry().values())
