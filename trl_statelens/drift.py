"""Drift of a state distribution: a lexical featurizer for prefix states and four distances between point sets.

A *state* is a prompt plus the prefix of an answer. Probe drift (see
:class:`~trl_statelens.callback.StateLoggingCallback`) samples the policy on fixed probe prompts, cuts every
completion into its word prefixes and compares their features with those of the same probes at step 0. The
featurized texts are the answer prefixes alone, without their prompts: the probe prompts are the same at every
measurement, so they would only add the same n-grams to both sets.

- :func:`featurize`: L2-normalised hashed word n-gram counts of each prefix text (lightweight, model-free, so drift
  measures what the policy writes, not how some encoder sees it);
- :func:`mmd2`: squared maximum mean discrepancy, RBF kernel with the median-heuristic bandwidth;
- :func:`centroid_distance`: Euclidean distance between the two means;
- :func:`sliced_wasserstein`: 1-Wasserstein distance averaged over random one-dimensional projections;
- :func:`jaccard`: Jaccard distance between the sets of hashed n-grams the two sets use.

Every distance is 0 for identical sets and takes two `(n, d)` and `(m, d)` tensors with the same `d`.
"""

from __future__ import annotations

import re
import zlib

import torch

WORD = re.compile(r"\w+|[^\w\s]")
NUM_FEATURES = 4096
NGRAM_SIZES = (1, 2)
NUM_PROJECTIONS = 128


def words(text: str) -> list[str]:
    """Lower-cased words and punctuation marks of ``text``, in order."""
    return WORD.findall(text.lower())


def featurize(texts: list[str], num_features: int = NUM_FEATURES, ngram_sizes: tuple[int, ...] = NGRAM_SIZES):
    """Hashed word n-gram counts of each text, L2-normalised: a `(len(texts), num_features)` float tensor.

    The hash is CRC32 of the n-gram (not Python's ``hash``, which changes between processes), so features of the same
    text are identical across runs and ranks. An empty text gives the zero vector.
    """
    rows, cols = [], []
    for row, text in enumerate(texts):
        tokens = words(text)
        for n in ngram_sizes:
            for start in range(len(tokens) - n + 1):
                gram = " ".join(tokens[start : start + n])
                rows.append(row)
                cols.append(zlib.crc32(gram.encode("utf-8")) % num_features)
    features = torch.zeros(len(texts), num_features, dtype=torch.float64)
    if rows:
        features.index_put_(
            (torch.tensor(rows), torch.tensor(cols)), torch.ones(len(rows), dtype=torch.float64), accumulate=True
        )
    return torch.nn.functional.normalize(features, dim=1)


def _check_point_sets(x: torch.Tensor, y: torch.Tensor) -> None:
    if x.ndim != 2 or y.ndim != 2 or x.size(1) != y.size(1):
        raise ValueError(
            f"expected two point sets of shape (n, d) and (m, d), got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    if x.size(0) == 0 or y.size(0) == 0:
        raise ValueError("cannot compare an empty point set")


def _median_distance(distances: torch.Tensor) -> float:
    off_diagonal = distances[~torch.eye(len(distances), dtype=torch.bool)]
    positive = off_diagonal[off_diagonal > 0]
    return positive.median().item() if positive.numel() else 1.0


def median_bandwidth(x: torch.Tensor, y: torch.Tensor) -> float:
    """Median of the pairwise Euclidean distances between distinct points of the pooled set (1.0 if all coincide)."""
    pooled = torch.cat([x, y]).double()
    return _median_distance(torch.cdist(pooled, pooled))


def mmd2(x: torch.Tensor, y: torch.Tensor, bandwidth: float | None = None) -> float:
    """Squared MMD with the RBF kernel ``exp(-|a-b|^2 / (2 bandwidth^2))``, biased (V-statistic) estimate.

    The biased estimate is exactly 0 for identical sets, which the unbiased one is not. ``bandwidth`` defaults to the
    median heuristic on the pooled set.
    """
    _check_point_sets(x, y)
    pooled = torch.cat([x, y]).double()
    distances = torch.cdist(pooled, pooled)  # one matrix serves the bandwidth and all three kernel blocks
    bandwidth = _median_distance(distances) if bandwidth is None else bandwidth
    kernel = torch.exp(-distances.square() / (2 * bandwidth**2))
    n = x.size(0)
    kxx, kyy, kxy = kernel[:n, :n].mean(), kernel[n:, n:].mean(), kernel[:n, n:].mean()
    return max((kxx + kyy - 2 * kxy).item(), 0.0)


def centroid_distance(x: torch.Tensor, y: torch.Tensor) -> float:
    """Euclidean distance between the means of the two sets."""
    _check_point_sets(x, y)
    return torch.linalg.vector_norm(x.double().mean(0) - y.double().mean(0)).item()


def _wasserstein_1d(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact W1 between the empirical distributions of the columns of `a` (n, k) and `b` (m, k): one value per column.

    W1 is the integral over u in (0, 1) of the gap between the two quantile functions, which are step functions with
    steps at i/n and j/m; summing over the merged steps is exact for any n and m.
    """
    a, b = a.sort(dim=0).values, b.sort(dim=0).values
    n, m = a.size(0), b.size(0)
    levels = torch.cat(
        [torch.arange(1, n + 1, dtype=torch.float64) / n, torch.arange(1, m + 1, dtype=torch.float64) / m]
    )
    levels = levels.sort().values
    widths = torch.diff(levels, prepend=levels.new_zeros(1))
    midpoints = levels - widths / 2
    index_a = (midpoints * n).long().clamp(max=n - 1)
    index_b = (midpoints * m).long().clamp(max=m - 1)
    return ((a[index_a] - b[index_b]).abs() * widths[:, None]).sum(0)


def sliced_wasserstein(
    x: torch.Tensor, y: torch.Tensor, num_projections: int = NUM_PROJECTIONS, seed: int = 0
) -> float:
    """1-Wasserstein distance between the projected sets, averaged over random unit directions.

    The directions come from a generator seeded with ``seed``, so the same two sets always give the same value.
    """
    _check_point_sets(x, y)
    generator = torch.Generator().manual_seed(seed)
    directions = torch.randn(x.size(1), num_projections, generator=generator, dtype=torch.float64)
    directions = torch.nn.functional.normalize(directions, dim=0)
    return _wasserstein_1d(x.double() @ directions, y.double() @ directions).mean().item()


def jaccard(x: torch.Tensor, y: torch.Tensor) -> float:
    """Jaccard distance ``1 - |A & B| / |A | B|`` between the features (hashed n-grams) each set uses at all."""
    _check_point_sets(x, y)
    used_x, used_y = (x != 0).any(0), (y != 0).any(0)
    union = (used_x | used_y).sum().item()
    return 1.0 - (used_x & used_y).sum().item() / union if union else 0.0


def drift_metrics(reference: torch.Tensor, current: torch.Tensor) -> dict[str, float]:
    """The four distances between a reference and a current feature set, under their logged names."""
    return {
        "mmd": mmd2(reference, current),
        "centroid": centroid_distance(reference, current),
        "sliced_wasserstein": sliced_wasserstein(reference, current),
        "jaccard": jaccard(reference, current),
    }


def prefix_states(completions: list[str]) -> list[str]:
    """The word prefixes of each completion (first word, first two words, ...): the states the policy visited.

    An empty completion (the policy stopped at once) is one empty state, so stopping early shows up as drift too.
    """
    states = []
    for completion in completions:
        tokens = completion.split()
        states.extend(" ".join(tokens[:end]) for end in range(1, len(tokens) + 1))
        if not tokens:
            states.append("")
    return states
