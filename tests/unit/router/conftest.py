"""Fixtures shared by the router's unit tests."""

from tests.unit.router._support import sim

__all__ = ["sim"]
