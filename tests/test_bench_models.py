"""``cudnorm bench --models``: the quick run end to end, the case filter, and the models
themselves (rotary embeddings, provider equivalence) on the CPU."""

from __future__ import annotations

import csv

import pytest
import torch

from cudnorm import cli
from cudnorm._bench import model_zoo, models


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # every model case (test_filter_selects_cases runs a few in the quick tier)
def test_quick_run_writes_every_case(tmp_path, capsys):
    assert cli.main(["bench", "--models", "--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "models.csv", newline="") as f:
        assert tuple(next(csv.reader(f))) == models.COLUMNS
    rows = _rows(tmp_path / "models.csv")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bound = 1e-3 if device == "cpu" else 5e-2  # fp32 on the CPU, bf16 models on a GPU
    expected = {c.id for c in model_zoo.select(model_zoo.all_cases(quick=True), None, device, quick=True)}
    assert {r["case"] for r in rows} == expected
    assert not any(r["mode"] == "train-compile" for r in rows)  # only when asked for, in quick mode
    for case in expected:
        got = {r["provider"]: r for r in rows if r["case"] == case}
        assert {"torch", "cudnorm"} <= set(got), case
        assert set(got) <= set(models.PROVIDERS)
        for r in got.values():
            assert r["status"] == "ok", r
            assert float(r["step_ms"]) > 0 and float(r["host_ms"]) > 0
        assert float(got["torch"]["speedup"]) == 1.0
        assert float(got["torch"]["rel_diff"]) == 0.0
        for peer in set(got) - {"torch"}:
            assert float(got[peer]["rel_diff"]) < bound, got[peer]
            if got[peer]["mode"] == "train":
                assert float(got[peer]["grad_rel_diff"]) < bound, got[peer]
    md = (tmp_path / "models.md").read_text()
    assert f"`cudnorm bench --models --quick --out {tmp_path}`" in md
    out = capsys.readouterr().out  # the tables come last
    assert out.rstrip().splitlines()[-1].startswith("gpt2-64-b2-s32:train")


def test_filter_selects_cases(tmp_path):
    assert cli.main(["bench", "--models", "dit", "--quick", "--out", str(tmp_path),
                     "--providers", "torch,cudnorm"]) == 0
    rows = _rows(tmp_path / "models.csv")
    assert rows and all(r["model"] == "dit" for r in rows)
    assert {r["mode"] for r in rows} == {"train", "infer"}
    assert "--models dit" in (tmp_path / "models.md").read_text()


def test_select_and_unknown_filter():
    cases = model_zoo.all_cases(quick=False)
    ids = {c.id for c in model_zoo.select(cases, "llama-4096:decode,gpt2", "cuda", quick=False)}
    assert ids == {"llama-4096:decode-b1", "llama-4096:decode-b32", "gpt2-1024-b8-s1024:train",
                   "gpt2-1024-b8-s1024:train-compile"}
    assert "dit-1152-b8-s1024:train-compile" in {c.id for c in model_zoo.select(cases, None, "cuda", quick=False)}
    on_cpu = model_zoo.select(cases, "dit-1152-b8", "cpu", quick=False)
    assert on_cpu and not any(c.compiled for c in on_cpu)  # compile only when the filter names it
    assert {c.mode for c in model_zoo.select(cases, "dit-1152-b8-s1024:train-compile", "cpu", quick=False)} == {
        "train-compile"}
    exact = model_zoo.select(cases, "dit-1152-b8-s256:train,gpt2-1024-b8-s1024:train-compile", "cuda", quick=False)
    assert [c.id for c in exact] == ["dit-1152-b8-s256:train", "gpt2-1024-b8-s1024:train-compile"]
    assert cli.main(["bench", "--models", "no-such-model", "--quick"]) == 2
    assert cli.main(["bench", "--models", "--quick", "--providers", "torch,nope"]) == 2


def test_rotary_is_a_relative_rotation():
    rope = model_zoo.Rotary(head_dim=16, max_pos=64).double()
    q, k = torch.randn(2, 1, 1, 16, dtype=torch.float64).unbind(0)
    q, k = q[None], k[None]
    # a rotation: norms are kept
    torch.testing.assert_close(rope(q, 5).norm(), q.norm())
    # scores depend only on the distance between the positions
    score = [(rope(q, m) * rope(k, m - 3)).sum() for m in (3, 10, 40)]
    torch.testing.assert_close(score[1], score[0])
    torch.testing.assert_close(score[2], score[0])
    # position 0 is the identity; channel i rotates with channel i + 8 by angle pos * base^(-i/8)
    torch.testing.assert_close(rope(q, 0), q)
    x = torch.zeros(1, 1, 1, 16, dtype=torch.float64)
    x[..., 1] = 1.0
    angle = torch.tensor(7 * 10000.0 ** (-2 / 16), dtype=torch.float64)
    got = rope(x, 7)[0, 0, 0]
    torch.testing.assert_close(got[[1, 9]], torch.stack([angle.cos(), angle.sin()]))
    assert got[[0, 2, 8, 10]].abs().max() == 0


def test_decode_matches_full_forward():
    """Token-by-token decode through the KV cache gives the causal full forward's outputs."""
    model = model_zoo.build_llama(32, 4, 64, 2, "torch", max_pos=16).double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    full = model(x)
    model.make_cache(2, context=16, prefill=0)
    steps = torch.cat([model.decode_step(x[:, i:i + 1]) for i in range(6)], dim=1)
    torch.testing.assert_close(steps, full)


@pytest.mark.parametrize("train", [False, True])
def test_dit_providers_agree(train):
    """The cudnorm-provider DiT and the torch-provider DiT have the same weights and give the
    same output (and gradients) in fp32 on the CPU."""
    ref, mine = (model_zoo.build_dit(32, 4, 2, p) for p in ("torch", "cudnorm"))
    for a, b in zip(ref.state_dict().values(), mine.state_dict().values()):
        assert torch.equal(a, b)
    x, c = torch.randn(2, 8, 32), torch.randn(2, 32)
    outs = []
    for model in (ref, mine):
        with torch.set_grad_enabled(train):
            out = model(x, c)
        if train:
            out.float().square().mean().backward()
        outs.append(out.detach())
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    if train:
        for a, b in zip(ref.parameters(), mine.parameters()):
            torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4)


def test_llama_and_gpt_providers_share_weights():
    for build in (lambda p: model_zoo.build_llama(32, 4, 64, 2, p, max_pos=16),
                  lambda p: model_zoo.build_gpt(32, 4, 2, p)):
        ref, mine = build("torch"), build("cudnorm")
        assert list(ref.state_dict()) == list(mine.state_dict())
        for a, b in zip(ref.state_dict().values(), mine.state_dict().values()):
            assert torch.equal(a, b)
        norm = ref.layers[0].modules()
        weights = [m.weight for m in norm if isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm))]
        assert weights and not torch.equal(weights[0], torch.ones_like(weights[0]))  # randomised


def _row(call, case, mode, provider, speedup):
    return {**models.blank_row(model_zoo.Case("dit", case, mode, 2, 8, 64, 4, 1), provider), "call": call,
            "case": f"{case}:{mode}", "speedup": speedup, "step_ms": 1.0, "host_ms": 1.0, "host_ratio": 1.0}


RESULTS = [  # two device calls of one results file, as benchmarks/results/<gpu>/models.csv keeps them
    _row("A", "dit-old", "train", "cudnorm", 1.50), _row("A", "dit-old", "train", "torch-again", 1.20),
    _row("B", "dit-x", "train", "cudnorm", 0.97), _row("B", "dit-y", "train", "cudnorm", 1.06),
    _row("B", "dit-x", "train", "torch-again", 1.02), _row("B", "dit-y", "infer", "cudnorm", 1.01),
    _row("B", "dit-y", "infer", "torch-again", 0.99),
]


def test_plot_draws_the_latest_call_sorted_with_its_noise_band():
    """models.png shows one run (the last call of a results file), cases sorted by cudnorm's
    speed-up, one panel per mode, the run's torch-again ratios as its band (not as bars)."""
    from cudnorm._bench import plots  # noqa: PLC0415

    call, latest = plots.latest_run(RESULTS)
    assert call == "B" and {r["call"] for r in latest} == {"B"}
    panels = plots.model_panels(latest, {"train": "train", "infer": "infer / decode"})
    assert [title for title, _, _ in panels] == ["train", "infer / decode"]
    (_, train, train_aa), (_, infer, infer_aa) = panels
    assert plots.sorted_cases(train) == ["dit-y", "dit-x"]  # 1.06 before 0.97
    assert train_aa == [1.02] and infer_aa == [0.99]
    assert all(provider != "torch-again" for _, provider, _ in train + infer)


def test_from_csv_redraws_the_plot_of_a_results_file(tmp_path, capsys):
    """``cudnorm bench --from-csv models.csv`` redraws models.png from a file holding several
    calls (the latest by default, ``--call`` another) and prints that call's tables."""
    import importlib.util  # noqa: PLC0415

    from cudnorm._bench import report  # noqa: PLC0415

    path = tmp_path / "models.csv"
    report.write_csv(RESULTS, path, columns=("call", *models.COLUMNS))
    assert cli.main(["bench", "--from-csv", str(path)]) == 0
    out = capsys.readouterr().out
    assert "DiT (AdaLN) (call B)" in out and "dit-old" not in out
    assert cli.main(["bench", "--from-csv", str(path), "--call", "A"]) == 0
    assert "dit-old" in capsys.readouterr().out
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "models.png").stat().st_size > 0
