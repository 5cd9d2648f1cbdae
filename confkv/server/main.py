"""Start the CONF-KV server: `conf-kv --model-path DIR --port 8080 --compression-enabled true` (or
`python -m confkv.server`, or `python serve.py` in a checkout; `--ray` for engine replicas on Ray Serve
behind one ingress). `conf-kv calibrate --model-path DIR` fits a model's retention confidence
ahead of serving it (`confkv.compress.predictor.fitting`)."""

from __future__ import annotations

import logging
import sys
import threading
import time

import uvicorn
from fastapi import FastAPI

from confkv.server.api import create_app
from confkv.server.serving import GenerateService
from confkv.server.settings import load_settings

log = logging.getLogger("conf_kv")
CUT_OFF_S = 2.0  # after the grace period: how long the cut-off requests' last answers may take to go out


class GracefulServer(uvicorn.Server):
    """On SIGTERM (or Ctrl-C): refuse new requests with 503, let running ones finish within the
    grace period, then exit. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.grace_s = grace_s
        self.draining = False
        self.exit_code = 0
        app.state.on_engine_dead = self.engine_died

    def engine_died(self, error: BaseException) -> None:
        """The engine loop is dead for good (`AsyncEngine`): exit non-zero, so that the orchestrator
        (Docker's restart policy, Kubernetes, systemd) starts a fresh process."""
        log.critical("the engine loop is dead (%r): exiting with status 1 to be restarted", error)
        self.exit_code = 1
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:
        service = getattr(self.app.state, "service", None)
        if self.draining or service is None:
            return super().handle_exit(sig, frame)
        self.draining = service.draining = True
        log.info("shutting down: new requests get 503; waiting up to %.0f s for running ones", self.grace_s)
        threading.Thread(target=self._drain, args=(service,), name="drain", daemon=True).start()

    def _drain(self, service: GenerateService) -> None:
        deadline = time.monotonic() + self.grace_s
        while service.admitted and time.monotonic() < deadline:
            time.sleep(0.1)
        if service.admitted:
            log.warning("grace period over with %d requests unfinished; they are cut off", len(service.admitted))
            service.engine.cut_off(
                f"the server is shutting down and its grace period ({self.grace_s:g} s) is over; retry on another "
                "replica or after the restart"
            )
            deadline = time.monotonic() + CUT_OFF_S  # their final events and error answers go out first
            while service.admitted and time.monotonic() < deadline:
                time.sleep(0.05)
        self.should_exit = True


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["calibrate"]:  # fit a model's retention confidence ahead of serving it
        from confkv.compress.predictor.fitting import main as calibrate

        return calibrate(argv[1:])
    settings = load_settings(argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.ray:
        try:
            from confkv.cluster.app import main as serve_on_ray
        except ImportError as error:
            raise SystemExit(f"--ray needs Ray Serve: pip install '.[distributed]' ({error})") from None
        return serve_on_ray(settings)
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=5,  # for connections still open once the requests are done
    )
    server = GracefulServer(config, app, settings.shutdown_grace_period)
    server.run()
    if server.exit_code:
        sys.exit(server.exit_code)


if __name__ == "__main__":
    main()
