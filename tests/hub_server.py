"""A hub server on 127.0.0.1 that huggingface_hub and HF datasets talk to through HF_ENDPOINT, for tests that must not
reach the network: a subclass answers each request (`answer`), and `send` writes the response."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LocalHub:
    def __init__(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub.answer(self, body=False)

            def do_GET(self):
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, request: BaseHTTPRequestHandler, body: bool) -> None:
        raise NotImplementedError

    @staticmethod
    def send(request, status: int, data: bytes, headers: dict, body: bool) -> None:
        request.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            request.send_header(key, value)
        request.end_headers()
        if body:
            request.wfile.write(data)
