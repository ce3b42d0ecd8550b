"""The judge's counters: per instance, in constant memory, and their Prometheus text."""

from __future__ import annotations

import bisect
import collections
import itertools

LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds
ENGINE_STATS = (
    "requests_finished",
    "tokens_generated",
    "step_failures",
    "running",
    "waiting",
)  # per engine, on request


class Metrics:
    """Counters per instance, for /genrm/metrics; the latency histogram is cumulative since
    start (counts per bucket upper bound, +Inf last, and the sum), in constant memory."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.latency: dict[str, list] = {}  # instance -> [bucket counts..., +Inf count, sum]

    def inc(self, instance: str, key: str, n: float = 1) -> None:
        self.counts[(instance, key)] += n

    def observe(self, instance: str, seconds: float) -> None:
        histogram = self.latency.get(instance)
        if histogram is None:
            histogram = self.latency[instance] = [0] * (len(LATENCY_BUCKETS) + 1) + [0.0]
        histogram[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        histogram[-1] += seconds

    def snapshot(self) -> dict:
        out: dict[str, dict] = collections.defaultdict(dict)
        for (instance, key), value in self.counts.items():
            out[instance][key] = value
        for instance, histogram in self.latency.items():
            cumulative = list(itertools.accumulate(histogram[:-1]))
            out[instance]["latency_s"] = {
                "buckets": [[b, c] for b, c in zip([*LATENCY_BUCKETS, "+Inf"], cumulative)],
                "sum": histogram[-1],
                "count": cumulative[-1],
            }
        return dict(out)


_COUNTERS = (
    ("requests", "judge requests admitted"),
    ("tokens_in", "prompt tokens judged"),
    ("tokens_out", "tokens the judge generated"),
    ("cache_hits", "requests answered from the judgment cache"),
    ("rejected_asleep", "requests refused while asleep"),
    ("errors_transport", "engine calls that failed in transport"),
    ("errors_engine", "requests an engine failed"),
    ("refused", "requests an engine refused"),
    ("cancelled", "requests whose callers gave up"),
    ("retries", "requests tried again after a failure not their own"),
    ("calls_split", "engine calls that failed as a whole and went again one request each"),
    ("engines_down", "engines that left dispatch"),
    ("engines_replaced", "new engines that took a dead one's place"),
    ("verdicts", "verdicts reported by reward code"),
    ("parse_failures", "verdicts reward code could not read"),
)
_HTTP_GAUGES = ("connections_open",)


def _label(value) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v) -> str:
    return repr(float(v)) if isinstance(v, float) else str(int(v))


def prometheus_text(snap: dict, gateway_errors: dict, relay_stats: dict | None = None, http: dict | None = None) -> str:
    """The Prometheus text format (0.0.4) of the judge's counters: per judge instance under
    the label ``route_key`` (``instance`` is Prometheus's own target label), no ``_created``
    series (they would change at every scrape)."""
    out: list[str] = []

    def family(name: str, kind: str, help_: str, samples: list) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(samples)

    for key, help_ in _COUNTERS:
        family(
            f"genrm_{key}_total",
            "counter",
            f"GenRM {help_}",
            [
                f'genrm_{key}_total{{route_key="{_label(inst)}"}} {_number(vals.get(key, 0))}'
                for inst, vals in snap.items()
            ],
        )
    family(
        "genrm_gateway_errors_total",
        "counter",
        "gateway answers other than 200, by kind",
        [f'genrm_gateway_errors_total{{kind="{_label(k)}"}} {n}' for k, n in sorted(gateway_errors.items())],
    )
    for k, n in sorted((http or {}).items()):
        kind = "gauge" if k in _HTTP_GAUGES else "counter"
        # a counter's name ends in _total once (connections_total is not ..._total_total)
        name = f"genrm_http_{k}" if kind == "gauge" else f"genrm_http_{k.removesuffix('_total')}_total"
        family(name, kind, f"judge gateway HTTP server: {k.replace('_', ' ')}", [f"{name} {n}"])
    for k, n in (relay_stats or {}).items():
        family(
            f"genrm_relay_{k}_total",
            "counter",
            f"judge process relay runtime: {k.replace('_', ' ')}",
            [f"genrm_relay_{k}_total {n}"],
        )
    samples = []
    for inst, vals in snap.items():
        h = vals.get("latency_s")
        if not h:
            continue
        label = _label(inst)
        for bound, count in h["buckets"]:
            le = "+Inf" if bound == "+Inf" else repr(float(bound))
            samples.append(f'genrm_latency_seconds_bucket{{route_key="{label}",le="{le}"}} {count}')
        samples.append(f'genrm_latency_seconds_sum{{route_key="{label}"}} {_number(float(h["sum"]))}')
        samples.append(f'genrm_latency_seconds_count{{route_key="{label}"}} {h["count"]}')
    family("genrm_latency_seconds", "histogram", "judge call latency", samples)
    return "\n".join(out) + "\n"
