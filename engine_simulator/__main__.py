"""``python -m engine_simulator [flags]``: parse config -> set up logging -> run. Nothing else."""

from __future__ import annotations

import asyncio
import sys

from engine_simulator.app import run
from engine_simulator.config import SimulatorConfig
from kvmesh.config import load_config
from kvmesh.logging import setup_logging


def main(argv: list[str] | None = None) -> None:
    config = load_config(SimulatorConfig, argv if argv is not None else sys.argv[1:], prog="engine_simulator")
    setup_logging("engine_simulator", config.log_level)
    asyncio.run(run(config))


if __name__ == "__main__":
    main()
