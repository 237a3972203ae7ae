"""The featurizer and the four drift distances, on hand-made point sets."""

import math

import pytest
import torch

from trl_statelens.drift import (
    centroid_distance,
    drift_metrics,
    featurize,
    jaccard,
    median_bandwidth,
    mmd2,
    prefix_states,
    sliced_wasserstein,
)

DISTANCES = [mmd2, centroid_distance, sliced_wasserstein, jaccard]


@pytest.fixture
def clouds():
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(40, 5, generator=generator)
    nearby = base + 0.05 * torch.randn(40, 5, generator=generator)
    shifted = base + 2.0
    return base, nearby, shifted


@pytest.mark.parametrize("distance", DISTANCES)
def test_identical_sets_give_zero(distance, clouds):
    base, _, _ = clouds
    assert distance(base, base.clone()) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("distance", [mmd2, centroid_distance, sliced_wasserstein])
def test_shifted_set_is_farther_than_nearby_set(distance, clouds):
    base, nearby, shifted = clouds
    assert distance(base, shifted) > distance(base, nearby) > 0


def test_jaccard_counts_used_features():
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    y = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    assert jaccard(x, y) == pytest.approx(1 - 1 / 3)  # used: {0, 1} vs {1, 2}
    assert jaccard(x, torch.tensor([[0.0, 0.0, 0.0, 1.0]])) == 1.0


def test_mmd2_matches_direct_computation(clouds):
    base, nearby, _ = clouds
    x, y = base[:12].double(), nearby[:9].double() + 0.3
    pooled = torch.cat([x, y])
    distances = [
        math.dist(pooled[i].tolist(), pooled[j].tolist())
        for i in range(len(pooled))
        for j in range(len(pooled))
        if i != j
    ]
    distances.sort()
    half = len(distances) // 2
    median = distances[half] if len(distances) % 2 else distances[half - 1]  # torch.median takes the lower middle
    assert median_bandwidth(x, y) == pytest.approx(median)

    def k(a, b):
        return math.exp(-(math.dist(a.tolist(), b.tolist()) ** 2) / (2 * median**2))

    xx = sum(k(a, b) for a in x for b in x) / len(x) ** 2
    yy = sum(k(a, b) for a in y for b in y) / len(y) ** 2
    xy = sum(k(a, b) for a in x for b in y) / (len(x) * len(y))
    assert mmd2(x, y) == pytest.approx(xx + yy - 2 * xy, rel=1e-9)


def test_sliced_wasserstein_of_a_translation_in_one_dimension():
    x = torch.tensor([[0.0], [1.0], [2.0]])
    # W1 between a set and its translation by c is |c| along any direction; here the only direction is +-1
    assert sliced_wasserstein(x, x + 0.5) == pytest.approx(0.5)
    # different sizes: {0, 1} vs {0, 0.5, 1}: quantile functions differ by 0.5 on a third of (0, 1)
    assert sliced_wasserstein(torch.tensor([[0.0], [1.0]]), torch.tensor([[0.0], [0.5], [1.0]])) == pytest.approx(
        1 / 6
    )


def test_featurize_is_normalised_and_deterministic():
    texts = ["Ava has 3 apples.", "ava HAS 3 apples .", "", "Then Ben sells 4."]
    features = featurize(texts)
    norms = torch.linalg.vector_norm(features, dim=1)
    assert norms[[0, 1, 3]].tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert norms[2] == 0  # empty text: zero vector
    assert torch.equal(features[0], features[1])  # lower-cased words and punctuation
    assert torch.equal(featurize(texts), features)


def test_prefix_states_and_drift_metrics():
    assert prefix_states(["a b c", ""]) == ["a", "a b", "a b c", ""]
    reference = featurize(prefix_states(["Ava starts with 3 apples.", "Ben starts with 4 coins."]))
    same = drift_metrics(reference, reference)
    assert set(same) == {"mmd", "centroid", "sliced_wasserstein", "jaccard"}
    assert all(value == pytest.approx(0.0, abs=1e-12) for value in same.values())
    near = drift_metrics(
        reference, featurize(prefix_states(["Ava starts with 5 apples.", "Ben starts with 4 coins."]))
    )
    far = drift_metrics(reference, featurize(prefix_states(["The capital of Kalo is Mite.", "The bird is red."])))
    for name in same:
        assert far[name] > near[name] > 0, name


def test_bad_point_sets_raise():
    with pytest.raises(ValueError, match="shape"):
        mmd2(torch.zeros(3, 2), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="empty"):
        centroid_distance(torch.zeros(0, 2), torch.zeros(3, 2))
