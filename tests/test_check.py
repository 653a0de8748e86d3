"""`posgpt check`: the quick run passes on this CPU, a wrong kernel is a failure and a non-zero
exit, the JSON holds every case, and the cases come from the registries and the config's options."""

from __future__ import annotations

import json

import pytest
import torch

from posgpt.core import cli
from posgpt.evaluation import check
from posgpt.model import ATTENTIONS, SCHEMES
from posgpt.model.kernels import sdpa
from posgpt.model.scores import SCORES
from posgpt.model.terms import Term

from helpers import exits_with, loaded


def test_the_grid_is_read_from_the_registries():
    """Every function, scheme, mask and score, and every option with every function and scheme (no model built)."""
    names = [name for name, _, _ in check.grid()]
    for function, scheme, mask, score in zip(ATTENTIONS, SCHEMES, check.MASKS, SCORES, strict=False):
        assert f"{function}/{scheme}/{mask}/{score}" in names
    assert {name.split("/")[0] for name in names} == set(ATTENTIONS)
    assert {name.split("/")[1] for name in names} == set(SCHEMES)
    assert {name.split("/")[3] for name in names if name.count("/") == 3} == set(SCORES)
    assert len(names) == len(ATTENTIONS) * len(SCHEMES) * (len(check.MASKS) * len(SCORES) + len(list(
        check.option_variants())))  # fmt: skip


def test_quick_passes_on_this_cpu_with_alibi(capsys):
    """The whole quick grid (about 20 s on the 2-core CPU) is what a user runs; here its rows with ALiBi: every
    function, mask, score and option, the kernels compared, flex skipped on a CPU with its reason, a refused
    combination and an option that changes nothing listed."""
    results = check.main(check.CheckConfig(quick=True, only="/alibi/"))
    ran = [r for r in results if r.passed is not None]
    assert ran and all(r.passed for r in ran)
    lines = capsys.readouterr().out.splitlines()  # one screen: the skips folded by kind, the summary last
    assert len(lines) <= 40 and f"{len(ran)} of {len(ran)} checks passed, 0 failed" in lines[-1]
    assert lines[0].startswith("Skipped ") and any("refused: combinations the config refuses" in s for s in lines)
    check.main(check.CheckConfig(quick=True, only="softmax/alibi/causal/scaled_dot/", verbose=True))
    rows = capsys.readouterr().out.splitlines()  # --verbose: every row, as it finishes
    assert rows[0].split()[:3] == ["case", "check", "max"] and any(" skip " in row for row in rows[1:-1])
    names = {r.case for r in ran}
    for function, layer in ATTENTIONS.items():  # every function with a kernel beside its reference is compared
        if any(not k.weights and (k.devices is None or "cpu" in k.devices) for k in layer.kernels.values()):
            biased = any(Term.POSITIONS in k.terms for k in layer.kernels.values())  # linear attention refuses ALiBi
            assert any(name.startswith(f"{function}/") for name in names) or not biased, function
    assert all(any(f"/{score}/" in name for name in names) for score, kind in SCORES.items() if kind.dot_product)
    assert all(any(f"/{score}/" in r.case for r in results) for score in SCORES)  # additive: eager only, listed
    skipped = [r for r in results if r.passed is None]
    assert any("flex" in r.case and "wrong numbers" in r.skipped for r in skipped)  # refused on a CPU, said why
    assert any(r.skipped.startswith("refused: ") for r in skipped)  # linear attention with a bias
    assert any("changes nothing" in r.skipped for r in skipped)  # rope_scaling without RoPE


def test_every_choice_option_is_a_variant():
    labels = [label for label, _ in check.option_variants()]
    for expected in ("rope_scaling=yarn", "rope_partial=neox", "attn_log_scaling=learned", "fire_per_layer=True"):
        assert expected in labels
    assert not any(label.startswith(("pos_encoding=", "attention=", "chunked_loss=")) for label in labels)


def test_a_wrong_kernel_fails_and_exits_non_zero(monkeypatch, capsys, tmp_path):
    real = sdpa.sdpa_attention

    def off_by_a_little(*args, **kwargs):
        return real(*args, **kwargs) + 1e-2

    monkeypatch.setattr(sdpa, "sdpa_attention", off_by_a_little)
    out = tmp_path / "check.json"
    argv = ["--quick", "true", "--only", "softmax/alibi/causal/", "--json", str(out)]
    err = exits_with(capsys, check.COMMAND, argv, 1)
    assert "checks failed (softmax/alibi/causal/" in err and "sdpa forward" in err
    saved = json.loads(out.read_text())
    failed = [c for c in saved["cases"] if c["passed"] is False]
    assert failed and all(c["error"] > c["tolerance"] for c in failed)  # sdpa's rows, and kernels built on it
    assert any(c["case"].endswith("/sdpa") for c in failed)
    assert all(c["passed"] is None for c in saved["cases"] if "/flex" in c["case"])  # listed as skipped on a CPU
    assert "failed" in saved["summary"] and saved["device"] == "cpu"


@pytest.mark.parametrize("only", ["linear/rope/causal/scaled_dot/chunked", "softmax/t5/bigbird/dot/sdpa"])
def test_the_full_case_checks_gradients_and_the_cache(only, tmp_path):
    results = check.main(check.CheckConfig(only=only, json=str(tmp_path / "c.json")))
    checks = {r.check: r for r in results if r.passed is not None}
    assert {"forward", "backward"} <= set(checks) and all(r.passed for r in checks.values())
    rows = json.loads((tmp_path / "c.json").read_text())["cases"]
    assert any(r["check"] == "cache" and r["passed"] for r in rows)  # the kernel's KV cache (or state)
    assert torch.is_grad_enabled()


def test_the_command_is_posgpts(capsys):
    from posgpt import cli as posgpt

    assert loaded(posgpt.MODES)["check"] is check.COMMAND
    with pytest.raises(SystemExit):
        cli.run(check.COMMAND, ["--help"])
    assert "--quick" in capsys.readouterr().out
