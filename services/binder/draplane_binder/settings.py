"""The binder's settings: one dataclass, filled from the command line or by tests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from draplane.scheduling.messages import DEFAULT_PREFIX
from draplane.scheduling.reservations import DEFAULT_LEASE_SECONDS
from draplane_binder.cluster_publisher import COALESCE_SECONDS, NEW_CLAIM_HOLD_SECONDS


@dataclasses.dataclass(slots=True)
class BinderSettings:
    nats_url: str = "nats://127.0.0.1:4222"
    nats_nkey_seed: str | None = None  # file with the binder's nkey seed (draplane nats-auth issue)
    nats_ca: str | None = None  # CA file that signed the NATS servers' TLS certificates
    kubeconfig: Path | None = None
    prefix: str = DEFAULT_PREFIX
    # Pods whose spec.schedulerName is in this list are ours. The local environment adds
    # default-scheduler because no kube-scheduler runs there.
    scheduler_names: tuple[str, ...] = ("draplane",)
    # Create template claims, clean reservedFor, deallocate: kube-controller-manager's job, which
    # runs in every cluster draplane knows (deploy/, `draplane up`, the tests and benchmarks).
    manage_claims: bool = False
    shards: int = 1
    # Placements written at once; each costs three apiserver writes.
    concurrency: int = 32
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    # Unschedulable pods are retried after this, doubling up to retry_max_seconds, and at once
    # (after retry_flush_seconds) when devices are released or nodes change.
    retry_initial_seconds: float = 1.0
    retry_max_seconds: float = 20.0
    retry_flush_seconds: float = 0.2
    # A gang member waiting for its gang's minCount gets the PodScheduled=False condition at once,
    # but a Warning FailedScheduling Event only once it has waited this long: members are created
    # one after the other, and a Warning on each of a gang that binds a moment later is noise.
    gang_wait_warning_seconds: float = 30.0
    # PreBind waits this long for the pod's PersistentVolumeClaims to be bound or provisioned
    # (kube-scheduler's VolumeBinding bindTimeoutSeconds, 600 by default), then tries it again.
    volume_bind_timeout_seconds: float = 600.0
    # PreBind waits this long after a claim's allocation for its devices' binding conditions
    # (kube-scheduler's DynamicResources bindingTimeout, 600 by default); the claim is then
    # deallocated and the pod tried again.
    binding_timeout_seconds: float = 600.0
    # Cluster-bucket writes gather this long before going out together (cluster_publisher): every
    # shard receives a burst for less than the same messages one by one. 0: each at once.
    feed_coalesce_seconds: float = COALESCE_SECONDS
    # A new claim that is not allocated waits this long for its allocation before it is written to
    # the cluster bucket as it is (cluster_publisher). 0: at once.
    feed_new_claim_hold_seconds: float = NEW_CLAIM_HOLD_SECONDS
    stream_replicas: int = 1  # 3 on a 3-server NATS cluster
    # Client-side limit of apiserver requests (--kube-api-qps/--kube-api-burst). Above the most the
    # binder wrote in bench/e2e.py (138 pods/s at 6 writes a pod, about 830 a second), so it caps a
    # runaway, not the work; the server's API Priority and Fairness is the finer guard.
    kube_api_qps: float = 1000.0
    kube_api_burst: int = 2000
    http_host: str = "127.0.0.1"
    http_port: int = 0
