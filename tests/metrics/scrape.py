"""Reading a process's /metrics in tests: one scrape as {(name, labels): value}."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return parse(response.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels` (0 when none)."""
    wanted = set(labels.items())
    return sum(v for (sample_name, sample_labels), v in samples.items()
               if sample_name == name and wanted <= sample_labels)


def has(samples: Samples, name: str) -> bool:
    return any(sample_name == name for sample_name, _ in samples)
