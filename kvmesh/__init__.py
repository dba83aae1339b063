"""kvmesh: a control plane for distributed LLM inference; this package is its shared library.

What every process imports: the gRPC service lifecycle (``server``, ``interceptors``, ``channels``),
config, errors, etcd membership, wire formats (``wire``, ``kv_events``), hashing, metrics, tracing
and clocks. It holds no service logic and imports no service, simulator or CLI (the ``kvmesh``
command and the local-mesh harness are ``kvmesh_cli``); ``lint-imports`` enforces this.
"""

__version__ = "0.1.0"
