"""An asyncio loop on a background thread, so synchronous code (a training loop) can drive peers."""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)


def _quiet_cancelled_connections(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """Python 3.11's StreamReaderProtocol asks a *cancelled* client_connected_cb task for its
    exception (fixed in 3.12), which raises CancelledError into the loop's handler: an ERROR and a
    traceback each time a daemon's incoming connection is cut by an orderly shutdown. Only that case is
    logged at DEBUG; everything else goes to asyncio's default handler."""
    if isinstance(context.get("exception"), asyncio.CancelledError):
        logger.debug("connection handler cancelled at shutdown: %s", context.get("message"))
        return
    loop.default_exception_handler(context)


class BackgroundLoop:
    def __init__(self, name: str = "lioncub-loop"):
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(_quiet_cancelled_connections)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (raises TimeoutError past ``timeout``)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def call_soon(self, callback, *args) -> None:
        self.loop.call_soon_threadsafe(callback, *args)

    def stop(self) -> None:
        if self.loop.is_running():
            async def cancel_all() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            try:
                self.run(cancel_all(), timeout=10)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()
