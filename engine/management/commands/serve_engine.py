"""`manage.py serve_engine`: the one process per GPU that owns the device and the matrix."""
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from engine.config import engine_settings
from engine.serving import serve
from gpu_engine.placement import parse_devices


class Command(BaseCommand):
    help = ("Serve this party's engine over ZeroMQ: loads the matrix once, warms up, then answers "
            "the web and Celery processes that set MORPHO_ENGINE_URL to the same address.")

    def add_arguments(self, parser):
        parser.add_argument("--url", default=engine_settings().url,
                            help="address to bind, ipc://PATH or tcp://HOST:PORT "
                                 "(default: MORPHO_ENGINE_URL)")
        parser.add_argument("--devices", default=None, metavar="IDS",
                            help="device ids this server owns, e.g. 0,1 (default: "
                                 "MORPHO_ENGINE_DEVICES; unset = one device, the current one); "
                                 "each epoch's placement shards or replicates its pages over them")
        parser.add_argument("--no-warmup", action="store_true",
                            help="take queries at once, compiling each batch shape on first use")

    def handle(self, *args, **options):
        url = options["url"]
        if not url:
            raise CommandError("no address to bind: pass --url or set MORPHO_ENGINE_URL "
                               "(e.g. ipc:///tmp/morpho-engine.sock)")
        if options["devices"] is not None:
            try:
                parse_devices(options["devices"])
            except ValueError as exc:
                raise CommandError(f"--devices: {exc}") from None
            # in force as if MORPHO_ENGINE_DEVICES said it: the engine settings are read again
            settings.MORPHO_ENGINE_DEVICES = options["devices"]
            engine_settings.cache_clear()
        warm = engine_settings().warm_up and not options["no_warmup"]
        code = serve(url, warm=warm)
        if code:
            raise SystemExit(code)
