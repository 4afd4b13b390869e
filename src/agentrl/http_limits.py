"""Limits both HTTP servers of the project apply to their connections (the OpenEnv environment server and the model
server): a request header must arrive whole within HEADER_TIMEOUT_S.

uvicorn's h11 protocol waits forever for a header (a timer starts only after a response): 200 sockets sending a
partial header stayed open on either server (issue 55), each holding a file descriptor and a slot. `HeaderDeadline`
is that protocol with a deadline: a connection that has not sent a whole request header within HEADER_TIMEOUT_S of
connecting or of its last answer is closed. It is uvicorn's own class otherwise, so it is given by name:

    uvicorn agentrl.serving.app:app --http agentrl.http_limits:HeaderDeadline     # make serve
    uvicorn.Config(app, http=HeaderDeadline)                                         # openenv_server
"""

from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0


class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request header is not whole within HEADER_TIMEOUT_S."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._header_late)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._deadline.cancel()
        self._deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._header_late)

    def handle_websocket_upgrade(self, event) -> None:
        self._deadline.cancel()  # the socket belongs to the WebSocket protocol from here
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc) -> None:
        self._deadline.cancel()
        super().connection_lost(exc)

    def _header_late(self) -> None:
        waiting = self.cycle is None or self.cycle.response_complete  # no request under way: only a header is due
        if waiting and not self.transport.is_closing():
            self.transport.close()
