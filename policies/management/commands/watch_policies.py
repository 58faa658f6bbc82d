"""`manage.py watch_policies`: print the batching policies this process applies, one JSON line per change."""
from __future__ import annotations

import json
import sys
import threading
import time

from django.core.management.base import BaseCommand

from policies.source import live_policies


def _line(policies) -> str:
    return json.dumps({"time": time.time(),
                       "policies": {lane: {"name": p.name, "mode": p.mode, "max_batch": p.max_batch}
                                    for lane, p in sorted(policies.items())}})


class Command(BaseCommand):
    help = ("Follow the active batching policies the way every engine does (the live watcher, "
            "no database read per query) and print each change as a JSON line.")

    def add_arguments(self, parser):
        parser.add_argument("--seconds", type=float, default=0.0,
                            help="stop after this many seconds (0: run until interrupted)")

    def handle(self, *args, seconds: float = 0.0, **options):
        changed = threading.Event()
        source = live_policies()  # loads the active policies once and starts the watcher
        source.on_change(changed.set)
        self.stdout.write(_line(source.current()))
        sys.stdout.flush()
        deadline = time.monotonic() + seconds if seconds > 0 else None
        while deadline is None or time.monotonic() < deadline:
            if changed.wait(0.1):
                changed.clear()
                self.stdout.write(_line(source.current()))
                sys.stdout.flush()
