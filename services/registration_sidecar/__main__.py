"""``python -m services.registration_sidecar [flags]``: parse config -> set up logging -> run."""

from __future__ import annotations

import asyncio
import sys

from kvmesh.config import load_config
from kvmesh.logging import setup_logging
from services.registration_sidecar.app import run
from services.registration_sidecar.config import SidecarConfig


def main(argv: list[str] | None = None) -> None:
    config = load_config(SidecarConfig, argv if argv is not None else sys.argv[1:], prog="registration_sidecar")
    setup_logging("registration_sidecar", config.log_level)
    asyncio.run(run(config))


if __name__ == "__main__":
    main()
