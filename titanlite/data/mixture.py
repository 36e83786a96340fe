"""Weighted mixtures: Megatron's blend notation, and which source each global sample comes from.

`"0.7 /data/web,0.2 /data/code,0.1 /data/math"` (a weight, then a path; a path alone weighs 1)
gives each source its share of the samples. The schedule is Megatron's blending rule (each sample
goes to the source furthest behind its share: megatron/core/datasets/helpers.cpp,
build_blending_indices), run once over one period of D samples, where D is the common denominator
of the normalized weights as written ("0.7" is 7/10; past 65,536 the shares are rounded to
1/65,536, each at least that). Every D consecutive samples then hold exactly weight x D of each
source, and any stretch of samples is within two of its share (measured: under 1.6). It is a pure function of the sample index, so any rank finds any sample's source and its
index within that source without talking to others.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from titanlite.errors import ConfigError

MAX_PERIOD = 1 << 16  # finer weights are rounded to multiples of 1/65536


@dataclass(frozen=True)
class Part:
    name: str  # what metrics call it: the path's last component, without suffix
    weight: Fraction  # normalized, exact as written
    path: str


def parse_mixture(items: list[str], key: str) -> list[Part]:
    """The parts of a mixture written as "weight path" items; ConfigError naming `key` on a bad weight."""
    raw = []
    for item in items:
        words = item.split(maxsplit=1)
        if len(words) == 1:
            words = ["1", words[0]]
        weight, path = words
        try:
            value = Fraction(weight)
        except (ValueError, ZeroDivisionError):
            value = None
        if value is None or value <= 0:
            raise ConfigError(
                f"{key}: weight '{weight}' of '{item}' is not a positive number; write each part as 'WEIGHT PATH', "
                "e.g. '0.7 /data/web'"
            )
        raw.append((value, path.strip()))
    if not raw:
        raise ConfigError(f"{key} is empty; give 'WEIGHT PATH' items, e.g. '0.7 /data/web,0.3 /data/code'")
    total = sum(w for w, _ in raw)
    names = unique_names([source_name(p) for _, p in raw])
    return [Part(name, w / total, p) for name, (w, p) in zip(names, raw)]


def source_name(path: str) -> str:
    """The path's last part before any glob: '/data/olmo/*.npy' is 'olmo'."""
    plain = list(itertools.takewhile(lambda part: not any(c in part for c in "*?["), Path(path.rstrip("/")).parts))
    stem = plain[-1] if plain else ""
    for suffix in (".npy", ".bin", ".idx"):
        stem = stem.removesuffix(suffix)
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", stem) or "source"


def unique_names(names: list[str]) -> list[str]:
    return [f"{n}_{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


class Schedule:
    """Sample n of the mixture -> (source, index of that source's sample)."""

    def __init__(self, weights: list[Fraction]):
        counts = period_counts(weights)
        self.period = sum(counts)
        order = np.zeros(self.period, dtype=np.int64)
        taken = [0] * len(counts)
        for n in range(self.period):  # Megatron's rule: the source furthest behind its share
            source = max(range(len(counts)), key=lambda i: (counts[i] * (n + 1) - taken[i] * self.period, -i))
            order[n] = source
            taken[source] += 1
        self.order = order
        self.per_period = np.asarray(counts, dtype=np.int64)
        # The index of sample n among its source's samples of the period.
        self.rank_in_period = np.zeros(self.period, dtype=np.int64)
        for source in range(len(counts)):
            where = order == source
            self.rank_in_period[where] = np.arange(where.sum())

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within the source) of each global sample index."""
        periods, offset = np.divmod(samples, self.period)
        source = self.order[offset]
        return source, periods * self.per_period[source] + self.rank_in_period[offset]

    def counts(self, samples: int) -> np.ndarray:
        """How many of the first `samples` samples each source supplied."""
        periods, offset = divmod(samples, self.period)
        return periods * self.per_period + np.bincount(self.order[:offset], minlength=len(self.per_period))


def period_counts(fractions: list[Fraction]) -> list[int]:
    """Integer shares of one period: the normalized weights over their common denominator, or rounded
    to MAX_PERIOD by largest remainder where that is larger."""
    period = math.lcm(*(f.denominator for f in fractions))
    if period <= MAX_PERIOD:
        return [int(f * period) for f in fractions]
    exact = [f * MAX_PERIOD for f in fractions]
    counts = [int(e) for e in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: MAX_PERIOD - sum(counts)]:
        counts[i] += 1
    for i in [i for i, c in enumerate(counts) if c == 0]:  # a tiny weight still reads its source
        counts[i] = 1
        counts[counts.index(max(counts))] -= 1
    return counts
