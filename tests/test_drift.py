"""The featurizer and the four drift distances, on hand-made point sets."""

import math

import pytest
import torch

from trl_statelens.lens.drift import (
    MAX_EXACT_STATES,
    NUM_FEATURES,
    PrefixFeatures,
    centroid_distance,
    drift_metrics,
    featurize,
    jaccard,
    median_bandwidth,
    mmd2,
    mmd2_random_features,
    prefix_states,
    probe_drift,
    sampled_median_bandwidth,
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


# ----- prefix features and probe drift above the exact budget ----------------------------------------------------
def synthetic_completions(seed, num_completions, max_words, first_word=0, num_words=200):
    """Completions of random words from `num_words` words starting at `first_word`; two sets drawn from overlapping
    ranges have a known, moderate drift."""
    generator = torch.Generator().manual_seed(seed)
    completions = []
    for _ in range(num_completions):
        length = int(torch.randint(max_words // 2, max_words + 1, (1,), generator=generator))
        ids = torch.randint(first_word, first_word + num_words, (length,), generator=generator)
        completions.append(" ".join(f"w{i}" for i in ids.tolist()))
    return completions


@pytest.fixture(scope="module")
def moderate_sets():
    """About 300 prefix states a side: the exact path is cheap, and far above the budget the tests set."""
    reference = synthetic_completions(0, 12, 40)
    current = synthetic_completions(1, 12, 40, first_word=40)
    return PrefixFeatures(reference), PrefixFeatures(current)


def test_prefix_features_are_featurize_of_prefix_states():
    completions = ["Ava has 3 apples.  Then\nBen, who (has) 4 ...", "", "ΑΣ ας ΣΑ x.y-z", "one", "a a a a b a"]
    features = PrefixFeatures(completions)
    dense = featurize(prefix_states(completions))
    assert features.num_states == len(prefix_states(completions))
    assert torch.equal(features.dense(), dense)  # bit for bit
    index = torch.tensor([5, 0, 8])
    assert torch.equal(features.dense(index), dense[index])
    assert torch.allclose(features.mean(), dense.mean(0), rtol=0, atol=1e-15)
    matrix = torch.randn(NUM_FEATURES, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.allclose(features.project(matrix), dense @ matrix, rtol=0, atol=1e-12)
    assert torch.equal(features.used(), (dense != 0).any(0))


def test_probe_drift_is_drift_metrics_within_the_budget():
    reference = ["Ava starts with 3 apples.", "Ben starts with 4 coins."]
    current = ["Ava starts with 5 apples.", "The bird is red."]
    exact = drift_metrics(featurize(prefix_states(reference)), featurize(prefix_states(current)))
    assert probe_drift(PrefixFeatures(reference), PrefixFeatures(current)) == exact  # the same values, exactly
    assert MAX_EXACT_STATES >= 16 * 64  # the default probe set (16 prompts x 64 tokens) stays exact


def test_probe_drift_above_the_budget_against_the_exact_values(moderate_sets):
    reference, current = moderate_sets
    exact = drift_metrics(reference.dense(), current.dense())
    estimate = probe_drift(reference, current, max_states=100)
    for name in ("centroid", "sliced_wasserstein", "jaccard"):  # exact up to float64 rounding in the running sums
        assert estimate[name] == pytest.approx(exact[name], rel=1e-9), name
    # MMD: random features (4096 frequencies) at a sampled-median bandwidth. The bound is about 3x the relative spread
    # measured over seeds on sets like these (2.4%; BENCHMARKS.md has the measurement on probe-sized sets)
    assert estimate["mmd"] == pytest.approx(exact["mmd"], rel=0.08)
    unchanged = probe_drift(reference, reference, max_states=100)
    assert all(value == 0.0 for value in unchanged.values()), unchanged  # an unchanged policy: exactly no drift


@pytest.mark.slow
def test_mmd_estimate_is_unbiased_and_its_bandwidth_is_the_median(moderate_sets):
    reference, current = moderate_sets
    exact_bandwidth = median_bandwidth(reference.dense(), current.dense())
    generator = torch.Generator().manual_seed(0)
    assert sampled_median_bandwidth(reference, current, 2048, generator) == pytest.approx(exact_bandwidth, rel=0.02)
    exact = mmd2(reference.dense(), current.dense(), bandwidth=exact_bandwidth)
    # Unbiased: the mean of 8 seeded estimates lands within 3% although each one varies (by about 4% at 1024
    # frequencies)
    estimates = torch.tensor(
        [mmd2_random_features(reference, current, num_frequencies=1024, seed=seed) for seed in range(8)]
    )
    assert abs(estimates.mean().item() / exact - 1) < 0.03
    assert estimates.std().item() / exact > 0.005
