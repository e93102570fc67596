"""The matmul backend the engine picks at start (engine/linear.py): the split from measured timings, the
KVOPS_LINEAR override, and that whichever path a row count takes computes F.linear's values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvops.engine import linear


@pytest.mark.parametrize(
    ("torch_ms", "onednn_ms", "rows"),
    [
        ([5.0, 6.0, 9.0], [8.0, 8.0, 8.0], 2),  # MKL's matrix-vector path wins at 1-2 rows (the Xeon here)
        ([5.0, 6.0, 7.0], [8.0, 8.0, 8.0], 4),
        ([5.0, 9.0, 5.0], [8.0, 8.0, 8.0], 1),  # a win at 4 after a loss at 2: one threshold, so 1
        ([9.0, 5.0, 5.0], [8.0, 8.0, 8.0], 0),  # no win at one row: oneDNN everywhere (the AMD machine)
        ([7.5, 7.5, 7.5], [8.0, 8.0, 8.0], 0),  # 6% faster is not clearly faster (10%)
    ],
)
def test_the_split_is_the_run_of_clear_wins_from_one_row(torch_ms, onednn_ms, rows):
    assert linear.torch_rows_from({"torch": torch_ms, "onednn": onednn_ms}) == rows


def test_an_unknown_kvops_linear_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv("KVOPS_LINEAR", "mkl")
    with pytest.raises(ValueError, match="KVOPS_LINEAR='mkl' is not one of auto, torch, onednn"):
        linear.select_linear(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("choice", ["torch", "onednn"])
def test_kvops_linear_forces_a_path_and_it_computes_f_linear(monkeypatch, choice):
    if choice == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch build has no oneDNN")
    monkeypatch.setenv("KVOPS_LINEAR", choice)
    generator = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(96, 64, generator=generator), torch.randn(96, generator=generator)
    name, fn = linear.select_linear(torch.device("cpu"), torch.float32, [weight])
    assert name == choice
    for rows in (1, 3, 16):
        x = torch.randn(rows, 64, generator=generator)
        torch.testing.assert_close(fn(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_auto_sends_row_counts_up_to_the_measured_split_to_f_linear(monkeypatch):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch build has no oneDNN")
    monkeypatch.delenv("KVOPS_LINEAR", raising=False)
    monkeypatch.setattr(linear, "torch_rows", lambda weights: (2, {"torch": [], "onednn": []}))
    taken: list[tuple[str, int]] = []
    for name in ("_torch_linear", "_onednn_linear"):
        real = getattr(linear, name)
        monkeypatch.setattr(linear, name, lambda x, w, b=None, real=real, name=name: taken.append((name, x.shape[0]))
                            or real(x, w, b))
    weight = torch.randn(32, 64)
    name, fn = linear.select_linear(torch.device("cpu"), torch.float32, [weight])
    assert name == "torch up to 2 rows, onednn above"
    taken.clear()  # select_linear checked oneDNN against F.linear once
    for rows in (1, 2, 3, 8):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(fn(x, weight, None), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert taken == [("_torch_linear", 1), ("_torch_linear", 2), ("_onednn_linear", 3), ("_onednn_linear", 8)]
