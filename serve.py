"""Start the CONF-KV server: `python serve.py --model-path DIR --port 8080 --compression-enabled true`."""

from __future__ import annotations

import logging
import sys

import uvicorn

from app.api import create_app
from app.settings import load_settings


def main(argv: list[str] | None = None) -> None:
    settings = load_settings(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level)


if __name__ == "__main__":
    main()
