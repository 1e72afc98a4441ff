"""The background loop's exception handler: what a daemon's shutdown does to connections is not an error."""
from __future__ import annotations

import asyncio
import logging

from lioncub_p2p.aio import BackgroundLoop


def test_connections_ended_by_a_stopping_daemon_are_debug_and_other_errors_stay_errors(caplog):
    loop = BackgroundLoop("aio-test")
    try:
        handler = loop.loop.get_exception_handler()
        with caplog.at_level(logging.DEBUG):
            handler(loop.loop, {"message": "Unhandled exception in client_connected_cb",
                                "exception": asyncio.IncompleteReadError(b"", 1)})
            handler(loop.loop, {"message": "Unhandled exception in client_connected_cb",
                                "exception": asyncio.CancelledError()})
            assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
            handler(loop.loop, {"message": "Unhandled exception in client_connected_cb",
                                "exception": asyncio.IncompleteReadError(b"\x01", 2)})  # cut mid-message
            handler(loop.loop, {"message": "Task exception was never retrieved",
                                "exception": asyncio.IncompleteReadError(b"", 1)})
            handler(loop.loop, {"message": "Unhandled exception in client_connected_cb",
                                "exception": ValueError("a bug")})
        assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 3
    finally:
        loop.stop()
