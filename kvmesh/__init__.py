"""kvmesh: a control plane for distributed LLM inference (shared library, no service logic)."""

__version__ = "0.1.0"
