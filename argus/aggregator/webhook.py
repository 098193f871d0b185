"""POST alerts to an Alertmanager-compatible webhook, with retries and exponential backoff."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Callable, List, Optional

from argus.aggregator.alerts import Alert, to_alertmanager


class Webhook:
    def __init__(
        self,
        url: str,
        retries: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        timeout_s: float = 5.0,
        say: Optional[Callable[[str], None]] = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"webhook URL must be http(s)://, got {url!r}")
        self.url = url
        self.retries, self.backoff_s, self.max_backoff_s, self.timeout_s = (
            retries,
            backoff_s,
            max_backoff_s,
            timeout_s,
        )
        self.say = say or (lambda _m: None)
        self.sleep = sleep
        self.sent = 0
        self.failed = 0

    def post(self, alerts: List[Alert]) -> bool:
        """Send one batch (Alertmanager's /api/v2/alerts body). True when a 2xx came back."""
        if not alerts:
            return True
        body = json.dumps(to_alertmanager(alerts)).encode()
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(
                self.url, data=body, method="POST", headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    if 200 <= resp.status < 300:
                        self.sent += len(alerts)
                        return True
                    err = f"HTTP {resp.status}"
            except urllib.error.HTTPError as e:
                err = f"HTTP {e.code}"
                if 400 <= e.code < 500 and e.code not in (408, 429):
                    break  # the receiver rejects this payload: retrying will not help
            except (urllib.error.URLError, OSError) as e:
                err = str(getattr(e, "reason", e))
            if attempt < self.retries:
                self.say(f"webhook {self.url}: {err}; retrying in {delay:.1f} s")
                self.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
        self.failed += len(alerts)
        self.say(f"webhook {self.url}: gave up on {len(alerts)} alert(s) ({err})")
        return False
