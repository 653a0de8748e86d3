"""The golden loss curves (`tests/golden.py`): training gives the losses it gave before a refactoring."""

from __future__ import annotations

import json

import pytest

from golden import GOLDEN, MODELS, STEPS, model_curve, trainer_curve


@pytest.fixture(scope="module")
def golden() -> dict[str, list[float]]:
    return json.loads(GOLDEN.read_text())


def test_the_golden_file_holds_every_curve_in_full(golden):
    assert set(golden) == {*MODELS, "trainer"}
    assert all(len(curve) == STEPS for curve in golden.values())
    assert all(curve[-1] < curve[0] for curve in golden.values())  # each of them learns


@pytest.mark.parametrize("name", MODELS)
def test_model_losses_match_the_golden_curve(golden, name):
    assert model_curve(MODELS[name]) == pytest.approx(golden[name], rel=1e-6)


def test_trainer_losses_match_the_golden_curve(golden, tmp_path, text_file):
    assert trainer_curve(tmp_path, text_file) == pytest.approx(golden["trainer"], rel=1e-6)
