"""A simulated vLLM 0.32 engine (not part of the mesh): OpenAI HTTP API, prefix cache with vLLM's
KV events over ZMQ, vLLM's /metrics, a step-based latency model, etcd registration.
See ``engine_simulator/README.md``."""
