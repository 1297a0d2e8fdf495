"""The ``cudnorm`` command's contract: bad input is one line naming the argument with exit
status 2; a file it cannot read or write is one line naming the path with exit status 1; no
traceback reaches the user. A fuzz of every command with bad flags, bad values, bad files and
odd paths checks it; then the smaller promises (``--version``, ``info`` and ``cache info``
agreeing on the store, ``cache clear`` on a store it cannot read, a quick benchmark that
writes into a temporary folder and says a CPU measures nothing about speed)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import cudnorm
from cudnorm import cli
from cudnorm._plan_store import encode_entry

REPO = Path(__file__).resolve().parent.parent


class _Accepted(BaseException):
    """Raised by the stand-ins of the commands' real work: the input got past every check.
    (A BaseException, so that no handler in the command takes it for an error of its own.)"""


@pytest.fixture
def no_real_work(monkeypatch):
    """Each command's expensive step refuses to run: a fuzz case that reaches it was accepted."""
    from cudnorm._bench import models, plots, report, runner  # noqa: PLC0415
    from cudnorm.cli import check, warmup  # noqa: PLC0415

    def accepted(*args, **kwargs):
        raise _Accepted

    monkeypatch.setattr(check, "check", accepted)
    monkeypatch.setattr(warmup, "warmup", accepted)
    monkeypatch.setattr(warmup, "resolve", accepted)
    monkeypatch.setattr(runner, "copy_bandwidth", accepted)
    monkeypatch.setattr(models, "run_cases", accepted)
    monkeypatch.setattr(plots, "ratio_plot", accepted)  # what --from-csv redraws
    monkeypatch.setattr(report, "plot", accepted)


@pytest.fixture
def odd_paths(tmp_path):
    """Name -> a path that no command can take as its input file or output folder."""
    folder = tmp_path / "folder"
    folder.mkdir()
    plain = tmp_path / "plain.txt"
    plain.write_text("not what any command reads\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    return {"missing": str(tmp_path / "missing.json"), "folder": str(folder), "fifo": str(fifo),
            "loop": str(loop), "dangling": str(dangling), "empty": "", "nul": "a\0b", "long": "x" * 5000,
            "under a file": str(plain / "child"), "plain": str(plain)}


def _bad_spec_files(tmp_path) -> dict[str, str]:
    """Spec files a user may hand ``cudnorm warmup`` by mistake."""
    good = {"op": "layer_norm", "phase": "train", "rows": 8, "cols": 64, "x_dtype": "bfloat16",
            "scale_dtype": "bfloat16", "device_index": 0}
    contents = {
        "deeply nested": '{"format": "cudnorm-specs", "version": 1, "specs": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "not JSON": "format: cudnorm-specs\n",
        "binary": "\udcff\udcfe",
        "JSON list": "[1, 2]",
        "other format": json.dumps({"format": "other", "version": 1, "specs": []}),
        "newer version": json.dumps({"format": "cudnorm-specs", "version": 99, "specs": []}),
        "specs not a list": json.dumps({"format": "cudnorm-specs", "version": 1, "specs": 7}),
        "device_index a string": json.dumps({"format": "cudnorm-specs", "version": 1,
                                             "specs": [{**good, "device_index": "0"}]}),
        "rows a float": json.dumps({"format": "cudnorm-specs", "version": 1, "specs": [{**good, "rows": 8.5}]}),
        "negative device": json.dumps({"format": "cudnorm-specs", "version": 1, "specs": [{**good, "device_index": -1}]}),
        "unknown dtype": json.dumps({"format": "cudnorm-specs", "version": 1, "specs": [{**good, "x_dtype": [1]}]}),
        "unknown field": json.dumps({"format": "cudnorm-specs", "version": 1, "specs": [{**good, "color": 1}]}),
        "missing field": json.dumps({"format": "cudnorm-specs", "version": 1, "specs": [{"op": "layer_norm"}]}),
    }
    return _written(tmp_path, "spec {}.json", contents)


def _bad_csv_files(tmp_path) -> dict[str, str]:
    """CSV files ``cudnorm bench --from-csv`` cannot redraw."""
    contents = {"huge field": "a" * 200_000, "binary": "\udcff\udcfe\n", "other columns": "a,b\n1,2\n",
                "empty": "", "bench header only": "op,shape,M,N,provider,status,path,plan,build_s,error,bound,ms,"
                                                   "gbps,pct_copy,speedup,best_peer,bytes\n",
                "bench row malformed": "op,shape,M,N,provider,status,path,plan,build_s,error,bound,ms,gbps,pct_copy,"
                                       "speedup,best_peer,bytes\nln_fwd,8x8,x,8,torch,ok,,,,,,,,,,,\n"}
    return _written(tmp_path, "{}.csv", contents)


def _written(folder: Path, pattern: str, contents: dict[str, str]) -> dict[str, str]:
    """name -> path of a file ``pattern.format(name)`` in ``folder`` holding ``contents[name]``
    (lone surrogates written as the bytes they stand for: files that are not UTF-8)."""
    paths = {}
    for name, text in contents.items():
        path = folder / pattern.format(name)
        path.write_bytes(text.encode("utf-8", "surrogateescape"))
        paths[name] = str(path)
    return paths


def _cases(paths: dict[str, str], specs: dict[str, str], csvs: dict[str, str]) -> list[list[str]]:
    """Every argv of the fuzz: each bad value of each argument on each command line that
    would otherwise run (its ``bases``)."""
    bad_ints = ["0", "-1", "x", "", "1.5", "nan", "1e99", "--"]
    odd = [p for name, p in paths.items() if name != "plain"]
    cases = [[], ["nope"], ["--nope"], ["--version=1"], ["info", "--nope"], ["info", "extra"], ["cache"],
             ["cache", "nope"], ["cache", "info", "--nope"], ["cache", "clear", "extra"], ["check", "extra"],
             ["warmup"], ["warmup", "--preset", "nope"], ["warmup", "--preset", "dit-xl-2", paths["plain"]],
             ["bench", "--call", "F"], ["bench", "--quick", "--nope"], ["bench", "--models", "no-such-model", "--quick"]]
    cases += [["check", "--device", v] for v in ("cuda", "cuda:0", "cuda:99", "meta", "cpu:x", "nope", "", "-1")]
    warmups = (["warmup", "--preset", "dit-xl-2"], ["warmup", "--preset", "llama-3-8b", "--json"],
               ["warmup", paths["plain"]])
    for base in warmups:
        for flag in ("--batch", "--seq", "--device"):
            cases += [base + [flag, v] for v in bad_ints if not (flag == "--device" and v == "0")]
        cases += [base + ["--dtype", v] for v in ("fp64", "int8", "", "bfloat", "torch.bf16")]
    cases += [["warmup", p] + extra for p in odd + list(specs.values()) for extra in ([], ["--no-progress"])]
    benches = (["bench", "--quick"], ["bench", "--models", "--quick"], ["bench", "--quick", "--cuda-graph"])
    values = {"--ops": ["nope", ",", "", "ln_fwd,nope"], "--providers": ["nope", ",", "", "torch,nope"],
              "--shapes": ["0x5", "12", "axb", "1x2x3x4", "", "-1x4", "4x", "1e3x4"], "--dtype": ["fp64", ""],
              "--out": [paths[n] for n in ("plain", "fifo", "empty", "nul", "long", "under a file")]}
    for base in benches:
        for flag, bad in values.items():
            cases += [base + [flag, v] for v in bad]
    cases += [["bench", "--models", "--quick", flag, v] for flag, v in (("--ops", "ln_fwd"), ("--shapes", "8x8"),
                                                                        ("--dtype", "fp32"))]
    cases += [["bench", "--quick", "--host-overhead", "--host-passes", v] for v in bad_ints]
    cases += [["bench", "--quick", "--host-passes", "3"], ["bench", "--models", "--quick", "--host-passes", "3"]]
    cases += [["bench", "--from-csv", p] + extra for p in odd + list(csvs.values()) for extra in ([], ["--call", "F"])]
    return cases


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    """``(status, stdout, stderr)`` of ``cudnorm <argv>`` run in this process; an exception
    other than argparse's exit escapes, as it would reach the user as a traceback."""
    try:
        status = cli.main(argv)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return status, out, err


def test_fuzz_no_traceback_reaches_the_user(no_real_work, odd_paths, tmp_path, capsys):
    """Bad input exits 2 with one line naming the argument; nothing gets past the checks to
    the command's real work (the stand-ins above), and no exception escapes."""
    cases = _cases(odd_paths, _bad_spec_files(tmp_path), _bad_csv_files(tmp_path))
    wrong = []
    for argv in cases:
        try:
            status, out, err = _run(argv, capsys)
        except _Accepted:
            wrong.append((argv, "accepted: reached the command's work"))
            continue
        except Exception as exc:  # noqa: BLE001 - what the user would see as a traceback
            wrong.append((argv, f"traceback: {type(exc).__name__}: {exc}"[:300]))
            continue
        lines = err.strip().splitlines()
        blamed = f"cudnorm {argv[0]}: " if argv and argv[0] in cli.SUBCOMMANDS else "cudnorm: "
        if status != 2 or len(lines) != 1 or "error: argument" not in lines[0] and "arguments" not in lines[0]:
            wrong.append((argv, f"status {status}, stderr {err[-300:]!r}"))
        elif not lines[0].startswith(blamed) or lines[0].count("(see ") != 1:
            wrong.append((argv, f"not one line of {blamed!r} with one '(see ...)': {lines[0][:300]!r}"))
        elif "Traceback" in out + err:
            wrong.append((argv, "a traceback was printed"))
    assert len(cases) > 250
    assert not wrong, "\n".join(f"{[a[:40] for a in argv]}: {why}" for argv, why in wrong[:20])


def test_files_that_cannot_be_read_exit_1_naming_the_path(tmp_path, monkeypatch, capsys):
    """A spec file or CSV that exists but cannot be opened (permissions): the command could
    not carry out its work, exit status 1, one line naming the file. As root nothing is
    unreadable, so the read raises what the system raises for a user without the right."""
    spec = tmp_path / "step.json"
    spec.write_text("{}")
    table = tmp_path / "bench.csv"
    table.write_text("op\n")
    for path in (spec, table):
        os.chmod(path, 0)
    if os.geteuid() == 0:
        real_open = open

        def refusing_open(file, *args, **kwargs):
            if os.fspath(file) in (str(spec), str(table)):
                raise PermissionError(13, "Permission denied", os.fspath(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr("builtins.open", refusing_open)
        monkeypatch.setattr(pathlib.Path, "read_text", lambda self, *a, **k: refusing_open(self).read())
    for argv, path in ((["warmup", str(spec)], spec), (["bench", "--from-csv", str(table)], table)):
        status, out, err = _run(argv, capsys)
        assert status == 1 and err.strip().splitlines() == [f"cudnorm {argv[0]}: error: {path}: Permission denied"], err


def test_cache_clear_of_a_store_it_cannot_read_exits_1_naming_the_directory(tmp_path, monkeypatch, capsys):
    """A fingerprint directory that cannot be listed hides its plans; ``cache clear`` used to
    exit 0 after removing nothing. It now removes what it can see and names the directory."""
    root = tmp_path / "plans"
    for name in ("fp-a", "fp-b"):
        (root / name).mkdir(parents=True)
        (root / name / "x.plan").write_bytes(encode_entry({"spec": {}, "fingerprint": {}}, b"blob"))
    hidden = root / "fp-b"
    real_iterdir = pathlib.Path.iterdir

    def iterdir(self):
        if self == hidden:
            raise PermissionError(13, "Permission denied", str(self))
        return real_iterdir(self)

    monkeypatch.setattr(pathlib.Path, "iterdir", iterdir)
    cudnorm.config(plan_store_dir=root)
    status, out, err = _run(["cache", "clear"], capsys)
    assert status == 1, (out, err)
    assert err.strip() == (f"cudnorm cache: error: cudnorm: could not read {hidden} (Permission denied): the "
                           "plans in it were not removed (1 other file(s) were)")
    assert not (root / "fp-a" / "x.plan").exists() and (hidden / "x.plan").exists()
    status, out, err = _run(["cache", "info"], capsys)
    assert status == 0 and "unreadable: unreadable directory (Permission denied)" in out


def test_info_and_cache_info_agree_on_the_store(tmp_path, monkeypatch, capsys):
    """Both name the directory the store uses: the configured one, or the default one when
    the option is None (``cudnorm info`` used to print ``plan_store_dir None``)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for configured in (None, tmp_path / "elsewhere"):
        cudnorm.config(plan_store_dir=configured)
        _, info_out, _ = _run(["info", "--json"], capsys)
        _, cache_out, _ = _run(["cache", "info", "--json"], capsys)
        shown = json.loads(info_out)["config"]["plan_store_dir"]
        assert shown == json.loads(cache_out)["path"] == str(configured or tmp_path / "xdg" / "cudnorm" / "plans")


def test_version_and_plain_help(capsys):
    status, out, _ = _run(["--version"], capsys)
    assert status == 0 and out.strip() == f"cudnorm {cudnorm.__version__}"
    status, out, _ = _run(["--help"], capsys)
    assert status == 0 and "``" not in out and "inspect the install" in out


def test_quick_bench_writes_into_a_temporary_folder_and_says_a_cpu_measures_nothing(tmp_path, monkeypatch,
                                                                                    capsys):
    """Without ``--out`` nothing is written under the working directory; on the CPU the run
    says, first and just before its tables, that its times say nothing about speed."""
    import torch  # noqa: PLC0415

    from cudnorm.cli import bench  # noqa: PLC0415

    work, temp = tmp_path / "work", tmp_path / "temp"  # the temporary folder goes with the test's
    work.mkdir()
    temp.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    status, out, _ = _run(["bench", "--quick", "--ops", "rms_fwd", "--providers", "cudnorm,torch"], capsys)
    assert status == 0
    assert list(work.iterdir()) == []
    folder = Path(out.splitlines()[0].removeprefix("writing into "))
    assert (folder / "bench.csv").is_file() and folder.parent == Path(tempfile.gettempdir()) == temp
    if not torch.cuda.is_available():
        assert out.count(bench.CPU_CAVEAT) == 2 and out.index(bench.CPU_CAVEAT, 200) < out.index("Legend:")
        # PyTorch's code against PyTorch's: no goal verdicts, and the copy named for what it is
        assert "slower than torch" not in out and "<90% copy" not in out
        assert "memory-to-memory copy on the CPU" in out and "device-to-device" not in out


def test_the_console_command_prints_no_traceback(tmp_path):
    """Through the interpreter as a user runs it: the version, and a spec file nested too
    deeply for the JSON decoder (once a RecursionError traceback)."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for argv, status in ((["--version"], 0), (["warmup", str(deep)], 2)):
        done = subprocess.run([sys.executable, "-m", "cudnorm.cli", *argv], capture_output=True, text=True,
                              env=env, timeout=300)
        assert done.returncode == status and "Traceback" not in done.stderr, done.stderr


def test_the_console_script_answers_version_without_importing_torch():
    """The entry point pyproject.toml names prints the version without importing the library
    (torch took 2-3 s of ``cudnorm --version``) and hands every other command line to
    :func:`cudnorm.cli.main`."""
    tomllib = pytest.importorskip("tomllib")
    entry = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["cudnorm"]
    module, _, function = entry.partition(":")
    probe = (f"import sys; from {module} import {function} as main; status = main(sys.argv[1:]); "
             "print('torch' in sys.modules, status)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", probe, "--version"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.stdout == f"cudnorm {cudnorm.__version__}\nFalse 0\n", done.stderr
    done = subprocess.run([sys.executable, "-c", probe, "check", "--bogus"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 2 and done.stderr.startswith("cudnorm check: error: unrecognized arguments: --bogus")
