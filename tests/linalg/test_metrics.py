import math

import pytest
import torch

from gradspec.linalg.metrics import (
    METRICS,
    metrics_dict,
    metrics_from_singular_values,
    singular_values_from_gram_eigenvalues,
)


def test_metrics_by_hand():
    sigma = torch.tensor([3.0, 1.0, 0.0])
    m = metrics_dict(metrics_from_singular_values(sigma))
    p = [0.75, 0.25]
    assert m["nuclear_norm"] == pytest.approx(4.0)
    assert m["effective_rank"] == pytest.approx(math.exp(-sum(q * math.log(q) for q in p)))
    assert m["spectral_norm"] == pytest.approx(3.0)
    assert m["frobenius_norm"] == pytest.approx(math.sqrt(10.0))
    assert m["stable_rank"] == pytest.approx(10.0 / 9.0)
    assert m["sigma1_ratio"] == pytest.approx(0.75)


def test_equal_singular_values_give_full_effective_rank():
    m = metrics_from_singular_values(torch.ones(7))
    assert m[METRICS.index("effective_rank")].item() == pytest.approx(7.0)


def test_zero_gradient_gives_nan_ratios_not_crash():
    m = metrics_dict(metrics_from_singular_values(torch.zeros(4)))
    assert m["nuclear_norm"] == 0.0
    assert math.isnan(m["effective_rank"]) and math.isnan(m["stable_rank"]) and math.isnan(m["sigma1_ratio"])


def test_gram_eigenvalues_drop_rounding_noise():
    lam = torch.tensor([-1e-14, 1e-20, 4.0, 9.0], dtype=torch.float64)
    assert singular_values_from_gram_eigenvalues(lam).tolist() == [3.0, 2.0, 0.0, 0.0]
