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
    traceback each time a daemon's incoming connection is cut by an orderly shutdown. The same shutdown
    can close a daemon connection before its stream info arrived (``_closed_before_its_stream_info``).
    Only these cases are logged at DEBUG; everything else (a cut in this project's own handlers, or
    after some bytes of a message) goes to asyncio's default handler."""
    error = context.get("exception")
    if isinstance(error, asyncio.CancelledError):
        logger.debug("connection handler cancelled at shutdown: %s", context.get("message"))
        return
    if _closed_before_its_stream_info(error):
        logger.debug("daemon connection closed before its stream info: %s", context.get("message"))
        return
    if loop.is_closed() and "task" in context:  # one that ignored its cancellation at stop(): logged there
        logger.debug("%s: %r", context.get("message"), context["task"])
        return
    loop.default_exception_handler(context)


def _closed_before_its_stream_info(error: BaseException | None) -> bool:
    """hivemind's daemon-connection handler (``control.py``'s ``_handler``) got end-of-stream before the
    stream info's message (in its length prefix): the daemon closed the connection unused, as it does
    at shutdown. Told apart by the traceback, so that the same error raised anywhere else still shows."""
    if not isinstance(error, asyncio.IncompleteReadError) or error.partial:
        return False
    frames, tb = [], error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    daemon = [code.co_name for code in frames if "p2p_daemon_bindings" in code.co_filename]
    return daemon[:1] == ["_handler"] and daemon[-1:] == ["read_unsigned_varint"]


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

    def stop(self, grace: float = 3.0) -> None:
        """Cancel every task, give them ``grace`` seconds to end, stop the loop. A task that outlives
        its cancellation (a library's cleanup awaiting a stream that no longer answers) is named in the
        log and left behind: leaving must not hang on it."""
        if self.loop.is_running():
            async def cancel_all() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                if not tasks:
                    return
                _, pending = await asyncio.wait(tasks, timeout=grace)
                if pending:
                    logger.info("%d tasks still running %.0f s after their cancellation, left behind: %s",
                                len(pending), grace, ", ".join(sorted(getattr(t.get_coro(), "__qualname__", repr(t)) for t in pending)))

            try:
                self.run(cancel_all(), timeout=grace + 5)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()
