"""``python -m services.epp [flags]``: parse config, set up logging, build, serve until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import sys

from kvmesh.config import load_config
from kvmesh.logging import setup_logging
from services.epp.app import build_service
from services.epp.config import EppConfig
from services.epp.framework.interfaces import ConfigError


def main(argv: list[str] | None = None) -> None:
    config = load_config(EppConfig, argv, prog="python -m services.epp")
    setup_logging("epp", config.log_level)
    logging.getLogger(__name__).info("config %s", config.model_dump(mode="json"))
    try:
        service = build_service(config)
    except ConfigError as exc:
        sys.stderr.write(f"epp: {exc}\n")
        raise SystemExit(2) from None
    asyncio.run(service.run())


if __name__ == "__main__":
    main()
