"""ui.wait_until_served: the launch's own "is the app reachable" check.

Gradio's check (networking.url_ok) gives up at the first 3 s timeout or refused connection and
then refuses to serve; under a loaded suite that failed an app fixture once. Ours waits out a
slow answer and a server that is not listening yet, and still fails clearly when nothing answers."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from collab_app.web.ui import wait_until_served
from tests.helpers.launch import free_port


def _serve(port: int, delay_s: float, status: int = 200) -> ThreadingHTTPServer:
    class Slow(BaseHTTPRequestHandler):
        def do_HEAD(self):
            time.sleep(delay_s)
            self.send_response(status)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_page_slower_than_gradios_3_s_check_is_waited_for():
    server = _serve(free_port(), delay_s=3.5)
    try:
        t0 = time.monotonic()
        wait_until_served(f"http://127.0.0.1:{server.server_address[1]}/", timeout_s=20)
        assert time.monotonic() - t0 >= 3.5
    finally:
        server.shutdown()


def test_a_server_that_starts_listening_later_is_waited_for():
    port = free_port()
    box = {}
    timer = threading.Timer(1.5, lambda: box.setdefault("server", _serve(port, delay_s=0)))
    timer.start()
    try:
        wait_until_served(f"http://127.0.0.1:{port}/", timeout_s=20)
        assert "server" in box
    finally:
        timer.join()
        box["server"].shutdown()


def test_nothing_listening_fails_with_the_url_and_what_to_check():
    url = f"http://127.0.0.1:{free_port()}/"
    with pytest.raises(RuntimeError, match="did not answer within 1 s.*proxy"):
        wait_until_served(url, timeout_s=1)


def test_server_errors_are_not_taken_for_an_app():
    server = _serve(free_port(), delay_s=0, status=503)
    try:
        with pytest.raises(RuntimeError, match="HTTP 503"):
            wait_until_served(f"http://127.0.0.1:{server.server_address[1]}/", timeout_s=1.5)
    finally:
        server.shutdown()
