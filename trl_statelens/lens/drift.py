"""Drift of a state distribution: a lexical featurizer for prefix states and four distances between point sets.

A *state* is a prompt plus the prefix of an answer. Probe drift (see
:class:`~trl_statelens.lens.callback.StateLoggingCallback`) samples the policy on fixed probe prompts, cuts every
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

Probe sets grow quickly: a completion of `L` words gives `L` prefix states, and the exact MMD compares every pair of
states (64 probes x 200 words are 12,800 states a side: 23 GB and 151 s for one exact MMD on 2 cores).
:class:`PrefixFeatures` therefore keeps the prefix states of a set of completions in linear memory (each completion's
hashed n-grams once, in the order its prefixes add them), and :func:`probe_drift` computes the four distances from it:

- up to `max_states` states a side (default :data:`MAX_EXACT_STATES`, 1024; the default 16 probes x 64 tokens give
  about 800), exactly as :func:`drift_metrics` on the dense features (the same values, bit for bit);
- above it, centroid distance, sliced Wasserstein and Jaccard stay exact, computed from running sums over each
  completion's n-grams (time and memory linear in the states), and MMD is estimated with random Fourier features
  (:func:`mmd2_random_features`): the mean of `|mean_i exp(i w.x_i) - mean_j exp(i w.y_j)|^2` over
  `num_frequencies` random frequencies `w`, an unbiased estimate of the same biased (V-statistic) MMD at a bandwidth
  that is the median over random pairs. Time is linear in the states and the frequencies; memory is linear in the
  states (the `(states, 128)` projections) plus blocks of at most `CHUNK_ELEMENTS` floats. Its error against the exact
  value and its cost are measured in BENCHMARKS.md (section 4.1) and pinned in `tests/test_drift.py`.
"""

from __future__ import annotations

import re
import zlib

import torch

WORD = re.compile(r"\w+|[^\w\s]")
NUM_FEATURES = 4096
NGRAM_SIZES = (1, 2)
NUM_PROJECTIONS = 128
MAX_EXACT_STATES = 1024  # above this many prefix states a side, MMD is estimated (see probe_drift)
NUM_FREQUENCIES = 4096  # random Fourier features of the MMD estimate
NUM_BANDWIDTH_PAIRS = 2048  # random pairs whose median distance is the bandwidth of the MMD estimate
CHUNK_ELEMENTS = 1 << 22  # float64 elements (32 MB) per intermediate block of the linear-memory path


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
    directions = _random_directions(x.size(1), num_projections, seed)
    return _wasserstein_1d(x.double() @ directions, y.double() @ directions).mean().item()


def _random_directions(dim: int, num_projections: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    directions = torch.randn(dim, num_projections, generator=generator, dtype=torch.float64)
    return torch.nn.functional.normalize(directions, dim=0)


def jaccard(x: torch.Tensor, y: torch.Tensor) -> float:
    """Jaccard distance ``1 - |A & B| / |A | B|`` between the features (hashed n-grams) each set uses at all."""
    _check_point_sets(x, y)
    return _jaccard_of_used((x != 0).any(0), (y != 0).any(0))


def _jaccard_of_used(used_x: torch.Tensor, used_y: torch.Tensor) -> float:
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


class PrefixFeatures:
    """The prefix states of a set of completions as hashed n-gram features, in memory linear in the states.

    Row `s` of :meth:`dense` is row `s` of `featurize(prefix_states(completions))`. Each completion's n-grams are
    stored once, in the order its word prefixes add them, so state `s` holds the n-grams `grams[starts[s]:ends[s]]`
    and its feature vector is their counts divided by `norms[s]`. Sums over states then become running sums over
    each completion's n-grams: time and memory grow with the number of states, not with its square.

    Args:
        completions (`list[str]`): the probe completions; each gives its word prefixes as states (as
            :func:`prefix_states`: one state per whitespace-separated word, one empty state for an empty completion).
        num_features, ngram_sizes: as in :func:`featurize`.
    """

    def __init__(self, completions: list[str], num_features: int = NUM_FEATURES, ngram_sizes=NGRAM_SIZES):
        grams, starts, ends, squared_norms = [], [], [], []
        for completion in completions:
            start, history, counts, squared_norm = len(grams), [], {}, 0
            tokens = completion.split()
            for token in tokens:
                for word in words(token):  # a prefix's words are those of its whitespace-separated tokens, in order
                    history.append(word)
                    for n in ngram_sizes:
                        if len(history) >= n:
                            gram = zlib.crc32(" ".join(history[-n:]).encode("utf-8")) % num_features
                            squared_norm += 2 * counts.get(gram, 0) + 1  # a count going from c to c + 1
                            counts[gram] = counts.get(gram, 0) + 1
                            grams.append(gram)
                starts.append(start)
                ends.append(len(grams))
                squared_norms.append(squared_norm)
            if not tokens:
                starts.append(start)
                ends.append(start)
                squared_norms.append(0)
        self.num_features = num_features
        self.grams = torch.tensor(grams, dtype=torch.long)
        self.starts = torch.tensor(starts, dtype=torch.long)
        self.ends = torch.tensor(ends, dtype=torch.long)
        self.norms = torch.tensor(squared_norms, dtype=torch.float64).sqrt()

    @property
    def num_states(self) -> int:
        return len(self.starts)

    def dense(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """The `(len(index), num_features)` features of the states `index` (all by default), as :func:`featurize`."""
        starts, ends = (self.starts, self.ends) if index is None else (self.starts[index], self.ends[index])
        lengths = ends - starts
        rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        positions = torch.repeat_interleave(starts - (lengths.cumsum(0) - lengths), lengths) + torch.arange(len(rows))
        features = torch.zeros(len(lengths), self.num_features, dtype=torch.float64)
        features.index_put_((rows, self.grams[positions]), torch.ones(len(rows), dtype=torch.float64), accumulate=True)
        return torch.nn.functional.normalize(features, dim=1)

    def _inverse_norms(self) -> torch.Tensor:
        # empty states are zero vectors; any other norm is at least 1 (integer counts), so the clamp only avoids 1 / 0
        return torch.where(self.norms > 0, 1 / self.norms.clamp(min=1), 0.0)

    def project(self, matrix: torch.Tensor) -> torch.Tensor:
        """`dense() @ matrix` for a `(num_features, k)` matrix, in its dtype, from running sums of its rows over each
        completion's n-grams, a block of columns at a time: no `(num_states, num_features)` tensor is built."""
        output = torch.empty(self.num_states, matrix.size(1), dtype=matrix.dtype)
        scale = self._inverse_norms().to(matrix.dtype)[:, None]
        width = max(1, CHUNK_ELEMENTS // max(1, len(self.grams)))
        running = None
        for column in range(0, matrix.size(1), width):
            block = matrix[:, column : column + width]
            if running is None or running.size(1) != block.size(
                1
            ):  # one buffer, refilled in place (fresh pages are slow)
                running = matrix.new_zeros(len(self.grams) + 1, block.size(1))
            torch.index_select(block, 0, self.grams, out=running[1:])
            running[1:].cumsum_(0)
            output[:, column : column + width] = (running[self.ends] - running[self.starts]) * scale
        return output

    def mean(self) -> torch.Tensor:
        """The mean feature vector: n-gram `t` counts in every state of its completion that ends after it, weighted
        by that state's `1 / norm`."""
        scale = self._inverse_norms()
        weights = torch.zeros(len(self.grams) + 1, dtype=torch.float64)
        weights.index_add_(0, self.starts, scale).index_add_(0, self.ends, -scale)
        weights = weights.cumsum(0)[:-1]
        total = torch.zeros(self.num_features, dtype=torch.float64).index_add_(0, self.grams, weights)
        return total / self.num_states

    def used(self) -> torch.Tensor:
        """Which features any state uses (a boolean `(num_features,)` tensor)."""
        used = torch.zeros(self.num_features, dtype=torch.bool)
        used[self.grams] = True
        return used


def _pooled_rows(x: PrefixFeatures, y: PrefixFeatures, index: torch.Tensor) -> torch.Tensor:
    """Dense rows of the pooled set (the states of `x`, then those of `y`)."""
    rows = torch.empty(len(index), x.num_features, dtype=torch.float64)
    in_x = index < x.num_states
    rows[in_x] = x.dense(index[in_x])
    rows[~in_x] = y.dense(index[~in_x] - x.num_states)
    return rows


def sampled_median_bandwidth(x: PrefixFeatures, y: PrefixFeatures, num_pairs: int, generator) -> float:
    """Median distance over `num_pairs` random pairs of distinct pooled states: :func:`median_bandwidth` estimated
    without the `(n + m)^2` distance matrix (zero distances left out as there; 1.0 if every pair coincides)."""
    total = x.num_states + y.num_states
    first = torch.randint(total, (num_pairs,), generator=generator)
    second = (first + torch.randint(1, total, (num_pairs,), generator=generator)) % total  # never the same state
    distances = []
    chunk = 256  # pairs at a time: 2 x 8 MB of dense rows
    for start in range(0, num_pairs, chunk):
        a, b = first[start : start + chunk], second[start : start + chunk]
        distances.append(torch.linalg.vector_norm(_pooled_rows(x, y, a) - _pooled_rows(x, y, b), dim=1))
    distances = torch.cat(distances)
    positive = distances[distances > 0]
    return positive.median().item() if positive.numel() else 1.0


def mmd2_random_features(
    x: PrefixFeatures,
    y: PrefixFeatures,
    num_frequencies: int = NUM_FREQUENCIES,
    num_pairs: int = NUM_BANDWIDTH_PAIRS,
    seed: int = 0,
) -> float:
    """Squared MMD of :func:`mmd2` estimated in time and memory linear in the states, with random Fourier features.

    The RBF kernel is the mean of `cos(w.(a - b))` over frequencies `w ~ N(0, I / bandwidth^2)`, so the biased MMD^2
    is the mean over `w` of `|mean_i exp(i w.x_i) - mean_j exp(i w.y_j)|^2`; this averages it over `num_frequencies`
    seeded draws (`w.x_i` from :meth:`PrefixFeatures.project`). For a given bandwidth the estimate is unbiased and
    its spread shrinks as `1 / sqrt(num_frequencies)`, relative to the value itself. The bandwidth is the median
    distance over `num_pairs` random pairs (:func:`sampled_median_bandwidth`). Two identical sets give exactly 0.
    """
    if x.num_features != y.num_features:
        raise ValueError(f"expected features of the same size, got {x.num_features} and {y.num_features}")
    if x.num_states == 0 or y.num_states == 0:
        raise ValueError("cannot compare an empty point set")
    generator = torch.Generator().manual_seed(seed)
    bandwidth = sampled_median_bandwidth(x, y, num_pairs, generator)
    width = max(1, CHUNK_ELEMENTS // max(len(x.grams), len(y.grams), x.num_states, y.num_states, x.num_features))
    total = 0.0
    for start in range(0, num_frequencies, width):
        count = min(width, num_frequencies - start)
        # float32 phases: their rounding (about 1e-5 rad) is far below the estimate's sampling error
        frequencies = torch.randn(x.num_features, count, generator=generator) / bandwidth
        phases_x, phases_y = x.project(frequencies), y.project(frequencies)
        gap_cos = phases_x.cos().mean(0) - phases_y.cos().mean(0)
        gap_sin = phases_x.sin().mean(0) - phases_y.sin().mean(0)
        total += (gap_cos.double().square() + gap_sin.double().square()).sum().item()
    return total / num_frequencies


def probe_drift(
    reference: PrefixFeatures, current: PrefixFeatures, max_states: int = MAX_EXACT_STATES, seed: int = 0
) -> dict[str, float]:
    """The four drift distances between two sets of prefix states, under their logged names.

    With at most `max_states` states on each side this is :func:`drift_metrics` on the dense features (exact, the
    same values). Above, in time and memory linear in the states: centroid, sliced Wasserstein and Jaccard are still
    exact (up to float64 rounding in the running sums), and MMD is :func:`mmd2_random_features`, seeded by `seed`.
    """
    if reference.num_features != current.num_features:
        raise ValueError(
            f"expected features of the same size, got {reference.num_features} and {current.num_features}"
        )
    if reference.num_states == 0 or current.num_states == 0:
        raise ValueError("cannot compare an empty point set")
    if reference.num_states <= max_states and current.num_states <= max_states:
        return drift_metrics(reference.dense(), current.dense())
    directions = _random_directions(reference.num_features, NUM_PROJECTIONS, seed=0)  # as sliced_wasserstein's
    return {
        "mmd": mmd2_random_features(reference, current, seed=seed),
        "centroid": torch.linalg.vector_norm(reference.mean() - current.mean()).item(),
        "sliced_wasserstein": _wasserstein_1d(reference.project(directions), current.project(directions))
        .mean()
        .item(),
        "jaccard": _jaccard_of_used(reference.used(), current.used()),
    }
