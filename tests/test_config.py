"""``cudnorm.Config`` / ``cudnorm.config`` / ``cudnorm.get_config``: changing the configuration
from now on and for a block, argument errors, what a change resizes or reinstalls, and the
environment seeding the configuration at import (a malformed value warns and the default is
used). The subprocess cases of issue 21 are in ``test_reliability.py``."""

import dataclasses
import os
import re
import threading
from pathlib import Path

import pytest
import torch

import cudnorm
from cudnorm import _cache, _runtime, _settings
from cudnorm._spec import NormSpec

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_setter_and_block():
    before = cudnorm.get_config()
    assert before.policy == "cudnn"  # conftest
    new = cudnorm.config(autotune="off")
    assert new == cudnorm.get_config() and new.autotune == "off" and new.policy == "cudnn"
    assert isinstance(new, cudnorm.Config)
    with cudnorm.config(policy="auto", exact_rows=0) as inside:
        assert cudnorm.get_config() == inside
        assert (inside.policy, inside.exact_rows, inside.autotune) == ("auto", 0, "off")
        with cudnorm.config(policy="cudnn"):
            assert cudnorm.get_config().policy == "cudnn"
        assert cudnorm.get_config() == inside
    assert cudnorm.get_config() == new
    with pytest.raises(RuntimeError), cudnorm.config(ada_forward="torch"):
        raise RuntimeError("the block fails")
    assert cudnorm.get_config() == new, "restored after an exception too"
    with cudnorm.config():  # no change; undoes the changes made inside at its end
        cudnorm.config(cache_size=7)
    assert cudnorm.get_config() == new


def test_equal_configurations_are_one_object():
    """Compiled code guards on the configuration object and memos are keyed on it: a block
    that repeats or restores a configuration must put the same object in place."""
    before = cudnorm.get_config()
    with cudnorm.config(policy="auto"):
        first = cudnorm.get_config()
    assert cudnorm.get_config() is before
    with cudnorm.config(policy="auto"):
        assert cudnorm.get_config() is first
    cudnorm.config(exact_rows=5)
    cudnorm.config(exact_rows=before.exact_rows)
    assert cudnorm.get_config() is before


def test_a_config_made_by_hand_runs_a_block():
    before = cudnorm.get_config()
    with cudnorm.Config(autotune="off") as chosen:
        assert cudnorm.get_config() == chosen == cudnorm.Config(autotune="off")
        assert cudnorm.get_config().policy == "auto", "every other option at its default"
    assert cudnorm.get_config() is before


def test_the_configuration_is_process_wide():
    seen = []
    with cudnorm.config(ada_backward="torch"):
        thread = threading.Thread(target=lambda: seen.append(cudnorm.get_config().ada_backward))
        thread.start()
        thread.join()
    assert seen == ["torch"]


@pytest.mark.parametrize("overrides, error, message", [
    ({"polcy": "auto"}, TypeError, "cudnorm.config: unknown option 'polcy'; the options are policy, autotune"),
    ({"policy": "fastest"}, ValueError, "cudnorm.config: option 'policy' must be 'auto', 'cudnn' or 'torch', got 'fastest'"),
    ({"autotune": "1"}, ValueError, "option 'autotune' must be 'auto', 'on' or 'off', got '1'"),
    ({"autotune": True}, TypeError, "option 'autotune' must be 'auto', 'on' or 'off', got True"),
    ({"autotune_candidates": 0}, ValueError, "option 'autotune_candidates' must be an integer >= 1 or 'all', got 0"),
    ({"autotune_candidates": "many"}, ValueError, "'autotune_candidates' must be an integer >= 1 or 'all'"),
    ({"cache_size": 0}, ValueError, "option 'cache_size' must be an integer >= 1, got 0"),
    ({"cache_size": "512"}, TypeError, "option 'cache_size' must be an integer >= 1, got '512'"),
    ({"cache_size": 2.0}, TypeError, "option 'cache_size' must be an integer >= 1, got 2.0"),
    ({"exact_rows": -1}, ValueError, "option 'exact_rows' must be an integer >= 0, got -1"),
    ({"exact_after": 0}, ValueError, "option 'exact_after' must be an integer >= 1, got 0"),
    ({"exact_rows": True}, TypeError, "option 'exact_rows' must be an integer >= 0, got True"),
    ({"fp32_weight_fwd": "graph"}, ValueError, "option 'fp32_weight_fwd' must be 'round' or 'native'"),
    ({"raw_execute": 0}, TypeError, "option 'raw_execute' must be True or False, got 0"),
    ({"plan_store_dir": 3}, TypeError, "option 'plan_store_dir' must be a path (str or os.PathLike) or None"),
    ({"plan_store_max_mb": float("nan")}, ValueError, "option 'plan_store_max_mb' must be a finite number >= 0"),
    ({"plan_store_max_mb": float("inf")}, ValueError, "option 'plan_store_max_mb' must be a finite number >= 0"),
    ({"plan_store_max_mb": -1}, ValueError, "option 'plan_store_max_mb' must be a finite number >= 0, got -1"),
])
def test_bad_options_name_the_option_and_what_it_takes(overrides, error, message):
    before = cudnorm.get_config()
    with pytest.raises(error, match=re.escape(message)):
        cudnorm.config(**overrides)
    assert cudnorm.get_config() is before, "a refused change changes nothing"
    if "polcy" not in overrides:
        with pytest.raises(error, match=re.escape(message.replace("cudnorm.config:", "cudnorm.Config:"))):
            cudnorm.Config(**overrides)


def test_cache_size_resizes_the_plan_cache():
    def spec(rows):
        return NormSpec("layer_norm", "train", rows, 64, torch.bfloat16, torch.bfloat16, 0)

    cudnorm.clear_cache()
    for rows in range(1, 6):
        _cache.plans.put(spec(rows), f"plan{rows}")
    with cudnorm.config(cache_size=2):
        info = cudnorm.cache_info()
        assert (info.capacity, info.size, info.evictions) == (2, 2, 3)
        assert [s.rows for s in _cache.plans.specs()] == [4, 5], "the least recently used go"
    assert cudnorm.cache_info().capacity == cudnorm.get_config().cache_size == 512
    cudnorm.clear_cache()


def test_disable_cudnn_is_the_kill_switch():
    with cudnorm.config(disable_cudnn=True):
        assert _runtime.cudnn_status().reason == "disabled by the configuration (disable_cudnn)"
    assert _runtime.cudnn_status().reason != "disabled by the configuration (disable_cudnn)"


def test_info_shows_the_configuration():
    with cudnorm.config(exact_rows=3):  # and the plan store's directory in use (None: the default one)
        shown = {**dataclasses.asdict(cudnorm.get_config()), "plan_store_dir": cudnorm.plan_store_info()["path"]}
        assert cudnorm.info()["config"] == shown
        assert cudnorm.info()["config"]["exact_rows"] == 3


# -- the environment seeds the configuration -------------------------------------------------
def test_environment_seeds_every_option():
    env = {"CUDNORM_POLICY": "CUDNN", "CUDNORM_AUTOTUNE": " 1 ", "CUDNORM_AUTOTUNE_CANDIDATES": "all",
           "CUDNORM_FP32_WEIGHT_FWD": "native", "CUDNORM_CACHE_SIZE": "64", "CUDNORM_EXACT_ROWS": "0",
           "CUDNORM_EXACT_AFTER": "3", "CUDNORM_ADA_FWD": "per_sample", "CUDNORM_ADA_BWD": "torch",
           "CUDNORM_RAW_EXECUTE": "off", "CUDNORM_PLAN_STORE": "no", "CUDNORM_PLAN_STORE_DIR": "~/plans",
           "CUDNORM_PLAN_STORE_MAX_MB": "1.5", "CUDNORM_DISABLE_CUDNN": "yes", "CUDNORM_NATIVE": "OFF",
           "CUDNORM_NATIVE_DIR": "/opt/cudnorm", "CUDNORM_MEASURE": "0"}
    assert sorted(env) == sorted(option.env for option in _settings.OPTIONS.values())
    assert _settings.from_environment(env) == cudnorm.Config(
        policy="cudnn", autotune="on", autotune_candidates="all", fp32_weight_fwd="native", cache_size=64,
        exact_rows=0, exact_after=3, ada_forward="per_sample", ada_backward="torch", raw_execute=False,
        plan_store=False, plan_store_dir="~/plans", plan_store_max_mb=1.5, disable_cudnn=True, native="off",
        native_dir="/opt/cudnorm", measure=False)
    assert _settings.from_environment({}) == cudnorm.Config()
    assert _settings.from_environment({"CUDNORM_CACHE_SIZE": "", "CUDNORM_DISABLE_CUDNN": " "}) == cudnorm.Config()
    assert _settings.from_environment({"CUDNORM_AUTOTUNE": "never"}).autotune == "off"


@pytest.mark.parametrize("variable, value, allowed, default", [
    ("CUDNORM_POLICY", "fastest", "'auto', 'cudnn' or 'torch'", "'auto'"),
    ("CUDNORM_AUTOTUNE", "maybe", "auto, on (1, true, yes, always) or off (0, false, no, never)", "'auto'"),
    ("CUDNORM_AUTOTUNE_CANDIDATES", "0", "an integer >= 1 or 'all'", "8"),
    ("CUDNORM_CACHE_SIZE", "abc", "an integer >= 1", "512"),
    ("CUDNORM_CACHE_SIZE", "0", "an integer >= 1", "512"),
    ("CUDNORM_EXACT_ROWS", "-1", "an integer >= 0", "1"),
    ("CUDNORM_EXACT_AFTER", "1.5", "an integer >= 1", "1"),
    ("CUDNORM_ADA_FWD", "cudnn_graph", "'auto', 'cudnn', 'per_sample' or 'torch'", "'auto'"),
    ("CUDNORM_RAW_EXECUTE", "2", "1, true, yes, on or 0, false, no, off", "True"),
    ("CUDNORM_PLAN_STORE_MAX_MB", "nan", "a finite number >= 0", "512"),
    ("CUDNORM_PLAN_STORE_MAX_MB", "inf", "a finite number >= 0", "512"),
    ("CUDNORM_PLAN_STORE_MAX_MB", "-1", "a finite number >= 0", "512"),
    ("CUDNORM_DISABLE_CUDNN", "maybe", "1, true, yes, on or 0, false, no, off", "False"),
    ("CUDNORM_NATIVE", "on", "'auto' or 'off'", "'auto'"),
])
def test_malformed_variable_warns_and_keeps_the_default(variable, value, allowed, default):
    message = f"cudnorm: ignoring {variable}={value!r}: it must be {allowed}; using the default, {default}"
    with pytest.warns(UserWarning, match=re.escape(message)):
        seeded = _settings.from_environment({variable: value, "CUDNORM_ADA_BWD": "torch"})
    assert seeded == cudnorm.Config(ada_backward="torch"), "the other variables still apply"


# -- the documentation lists every option ----------------------------------------------------
def test_configuration_table_lists_every_option():
    """docs/concepts.md's table: one row per field, in order, with its default and variable."""
    rows = {}
    for line in (DOCS / "concepts.md").read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in _settings.OPTIONS:
            rows[cells[0]] = cells
    assert list(rows) == list(_settings.OPTIONS)
    for field in dataclasses.fields(cudnorm.Config):
        _, _, default, variable, _ = rows[field.name]
        assert (default, variable) == (repr(field.default), _settings.OPTIONS[field.name].env), field.name


# -- warnings point at the caller's line -----------------------------------------------------
def _line_of(marker: str) -> int:
    """The line of this file that ends with ``# <marker>``."""
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.endswith(f"# {marker}"))


def test_warnings_point_at_the_callers_line(monkeypatch, tmp_path):
    """Each warning is attributed to the user's line, however deep in cudnorm (under a
    module's forward, a ``with`` block's exit) it was raised."""
    import emulated_cudnn  # noqa: PLC0415

    from cudnorm import _graphs  # noqa: PLC0415

    def refuse(spec):
        raise RuntimeError("no engine")

    saved = emulated_cudnn.install()
    try:
        _cache._build = saved[1]  # the real miss path, which warns when cuDNN declines (uninstall restores it)
        monkeypatch.setattr(_graphs, "build_plan", refuse)
        norm = cudnorm.LayerNorm(64)
        with pytest.warns(RuntimeWarning, match="cuDNN declined") as caught:
            norm(torch.randn(4, 64))  # declined
    finally:
        emulated_cudnn.uninstall(saved)
        cudnorm.clear_cache()
    found = [(w.filename, w.lineno) for w in caught]
    with pytest.warns(RuntimeWarning, match="swapped no norm") as more:
        cudnorm.patch(torch.nn.Linear(2, 2))  # patched nothing
    found += [(w.filename, w.lineno) for w in more]
    with pytest.warns(RuntimeWarning, match="no cuDNN graph was requested") as more:
        with cudnorm.record_specs():  # recorded nothing
            cudnorm.layer_norm(torch.randn(2, 4), (4,))
    found += [(w.filename, w.lineno) for w in more]
    assert found == [(__file__, _line_of(marker)) for marker in ("declined", "patched nothing", "recorded nothing")]


def test_a_malformed_variable_warns_at_the_import_line(tmp_path):
    """The environment is read while ``import cudnorm`` runs: its warning names the line of
    the import, not cudnorm's settings module."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    script = tmp_path / "job.py"
    script.write_text("import os\nimport cudnorm\n")
    path = os.pathsep.join(filter(None, [str(Path(cudnorm.__file__).parent.parent), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path, "CUDNORM_CACHE_SIZE": "abc"})
    assert done.returncode == 0, done.stderr
    assert f"{script}:2: UserWarning: cudnorm: ignoring CUDNORM_CACHE_SIZE='abc'" in done.stderr, done.stderr
