"""The replicas' engine series on the API server's /metrics, each sample labelled with its
replica, as vLLM labels its engines (`engine="0"`, `engine="1"`, ...): finished completions,
generation tokens, running and waiting requests, KV-cache usage and the rest that
`AsyncEngine` records in each replica (server/metrics.py). The API server's own series (HTTP
requests by endpoint and status, the model's info) keep their names and labels.

Each replica's families arrive as prometheus_client `Metric`s (pickled, no text to parse), are
kept until the next scrape replaces them, and are merged by name at exposition. A replica that
is not ready has none (its counters restart from zero with it: Prometheus reads that as a
reset); `replica_up` and `replica_restarts` say which are running and how often Ray restarted
them."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

ENGINE_LABEL = "engine"


class ReplicaMetrics:
    """A prometheus_client collector, registered in the API server's registry."""

    def __init__(self, num_replicas: int):
        self.num_replicas = num_replicas
        self._families: dict[int, list[Metric]] = {}
        self._up = [False] * num_replicas
        self._restarts = [0] * num_replicas

    def update(self, replica: int, families: list[Metric]) -> None:
        self._families[replica] = families

    def set_state(self, replica: int, up: bool, restarts: int) -> None:
        self._up[replica] = up
        self._restarts[replica] = restarts
        if not up:
            self._families.pop(replica, None)

    def describe(self) -> list:
        """None: which families exist depends on what the replicas report (a collector that
        describes nothing is not checked against the registry's other names, and the server's
        ServerMetrics, built without engine series, shares none of them)."""
        return []

    def collect(self):
        merged: dict[str, Metric] = {}
        for replica, families in sorted(self._families.items()):
            for family in families:
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation,
                                                        family.type, family.unit)
                into.samples += [sample._replace(labels={**sample.labels,
                                                         ENGINE_LABEL: str(replica)})
                                 for sample in family.samples]
        yield from merged.values()
        yield from self._pool_families()

    def _pool_families(self):
        up = GaugeMetricFamily("kvslim_replica_up", "1 while the replica's engine runs",
                               labels=[ENGINE_LABEL])
        restarts = CounterMetricFamily("kvslim_replica_restarts", "Times Ray restarted the "
                                       "replica", labels=[ENGINE_LABEL])
        for replica in range(self.num_replicas):
            up.add_metric([str(replica)], float(self._up[replica]))
            restarts.add_metric([str(replica)], float(self._restarts[replica]))
        ready = GaugeMetricFamily("kvslim_replicas_ready", "Replicas running",
                                  value=float(sum(self._up)))
        wanted = GaugeMetricFamily("kvslim_replicas", "Replicas asked for (--data-parallel-size)",
                                   value=float(self.num_replicas))
        return [up, restarts, ready, wanted]
