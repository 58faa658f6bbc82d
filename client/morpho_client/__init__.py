"""morpho-client: fetch rows privately from two morphoweb PIR parties (sync and asyncio)."""
from morpho_client.aio import AsyncPirClient
from morpho_client.core import (Answer, EpochInfo, EpochMismatch, PirError, SameServer,
                                ServerError, StateMismatch, check_distinct_servers,
                                server_address)
from morpho_client.lookup import NotRecords
from morpho_client.plan import Window, plan_window
from morpho_client.sync import PirClient

__all__ = ["Answer", "AsyncPirClient", "EpochInfo", "EpochMismatch", "NotRecords", "PirClient", "PirError",
           "SameServer", "ServerError", "StateMismatch", "Window", "check_distinct_servers",
           "plan_window", "server_address"]
