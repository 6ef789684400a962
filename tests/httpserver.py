"""A threaded HTTP server on 127.0.0.1 for the download tests, with misbehaviours on demand."""

import http.server
import threading
from dataclasses import dataclass, field


@dataclass
class Route:
    body: bytes = b""
    status: int = 200
    honor_range: bool = True
    drop_first_after: int | None = None  # first GET: promise the whole body, send this many bytes, hang up
    fail_first: int = 0  # answer 503 to this many GETs first
    content_type: str | None = None
    requests: list = field(default_factory=list)  # Range header of each GET (None when absent)


class Server:
    def __init__(self):
        self.routes: dict[str, Route] = {}
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                route = server.routes.get(self.path)
                if route is None:
                    self.send_error(404)
                    return
                route.requests.append(self.headers.get("Range"))
                if route.fail_first:
                    route.fail_first -= 1
                    self.send_error(503)
                    return
                if route.status != 200:
                    self.send_error(route.status)
                    return
                body, start = route.body, 0
                rng = self.headers.get("Range")
                if rng and route.honor_range:
                    start = int(rng.split("=")[1].split("-")[0])
                    if start >= len(body):
                        self.send_error(416)
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body) - start))
                if route.content_type:
                    self.send_header("Content-Type", route.content_type)
                self.end_headers()
                if route.drop_first_after is not None:
                    self.wfile.write(body[start:start + route.drop_first_after])
                    self.wfile.flush()
                    route.drop_first_after = None
                    self.close_connection = True
                    return
                self.wfile.write(body[start:])

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
