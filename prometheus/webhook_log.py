"""Alertmanager's default receiver: logs one line per alert of each webhook notification it gets.

    python webhook_log.py --port 9095

The path of the webhook URL names the receiver (/pager, /log), so the log says which route an alert
took. Standard library only, so any Python 3.11 image runs it.
"""

from __future__ import annotations

import argparse
import json
import logging
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("alerts")


def lines(receiver: str, notification: dict) -> list[str]:
    """One line per alert: receiver, status, name, instance, severity, summary and runbook."""
    out = []
    for alert in notification.get("alerts", []):
        labels, notes = alert.get("labels", {}), alert.get("annotations", {})
        out.append(
            f"{receiver} {alert.get('status', '?')} {labels.get('alertname', '?')} "
            f"instance={labels.get('instance', '-')} severity={labels.get('severity', '-')}: "
            f"{notes.get('summary', '')} | {notes.get('description', '')} | runbook {notes.get('runbook_url', '-')}"
        )
    return out


class Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            notification = json.loads(body)
        except ValueError:
            self.send_response(400)
            self.end_headers()
            return
        for line in lines(self.path.strip("/") or "webhook", notification):
            log.info(line)
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass  # the alert lines are the log; no access log beside them


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9095)
    args = parser.parse_args()
    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.INFO)
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
