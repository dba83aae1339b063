"""``python -m services.router [flags]``: parse config, set up logging, run the service."""

from __future__ import annotations

import asyncio
import logging

from kvmesh.config import load_config
from kvmesh.logging import setup_logging
from services.router.config import RouterConfig
from services.router.service import build_service


def main(argv: list[str] | None = None) -> None:
    config = load_config(RouterConfig, argv, prog="python -m services.router")
    setup_logging("router", config.log_level)
    logging.getLogger(__name__).info("config %s", config.model_dump(mode="json"))
    asyncio.run(build_service(config).run())


if __name__ == "__main__":
    main()
