"""kvmesh router: the OpenAI-compatible HTTP front door and the gRPC Inference API (see README.md)."""
