"""``python -m engine_simulator [flags]``: :func:`kvmesh.server.main` over ``SimulatorConfig`` and ``app.build_service``."""

from engine_simulator.app import build_service
from engine_simulator.config import SimulatorConfig
from kvmesh.server import main

if __name__ == "__main__":
    main(SimulatorConfig, build_service, prog="engine_simulator", name="engine_simulator")
