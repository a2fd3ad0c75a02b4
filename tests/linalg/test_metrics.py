import math

import pytest
import torch

from gradspec.linalg.metrics import (
    METRICS,
    metrics_dict,
    metrics_from_singular_values,
    metrics_of_groups,
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


def test_metrics_of_groups_equal_each_groups_own():
    """Padded to one length and computed at once, bit for bit what each group gives alone: zero rows
    (NaN ratios), a group of one value, one of none, different shapes."""
    g = torch.Generator().manual_seed(0)
    sigmas = [torch.rand(3, 2, 7, generator=g, dtype=torch.float64), torch.rand(4, 1, generator=g, dtype=torch.float64),
              torch.zeros(2, 5, dtype=torch.float64), torch.rand(2, 3, 0, dtype=torch.float64),
              torch.rand(5, 11, generator=g, dtype=torch.float64) ** 8]
    for joint, sigma in zip(metrics_of_groups(sigmas), sigmas, strict=True):
        torch.testing.assert_close(joint, metrics_from_singular_values(sigma), rtol=0, atol=0, equal_nan=True)
    assert metrics_of_groups([]) == []
