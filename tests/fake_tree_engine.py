"""A launched "engine" that is a process tree, for the tests of how tune stops what it launched.

``python fake_tree_engine.py --port P --pids FILE --mode serve|silent|refuse --k K``: starts a child
(``sleep``, as an engine starts its workers), writes its own pid and the child's to FILE, then either
serves (``/v1/models`` answers; a completion request is accepted, written to FILE + ".request", and never
answered), refuses every completion (HTTP 400), or listens on nothing (a server still loading). It never
ends by itself; ``--k`` is taken and ignored.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_servers import QuietHandler  # noqa: E402  (tests/ on the path when run as a script)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pids", required=True)
    parser.add_argument("--mode", choices=("serve", "silent", "refuse"), required=True)
    parser.add_argument("--k", type=int, default=0)
    args = parser.parse_args()
    worker = subprocess.Popen(["sleep", "600"])
    marker = Path(args.pids)
    marker.with_suffix(".tmp").write_text(f"{os.getpid()} {worker.pid}\n")
    marker.with_suffix(".tmp").rename(marker)
    if args.mode == "silent":
        while True:
            time.sleep(1)

    class Handler(QuietHandler):
        def do_GET(self):  # noqa: N802 (http.server API)
            self.reply_json({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

        def do_POST(self):  # noqa: N802
            Path(str(marker) + ".request").write_text("1")
            if args.mode == "refuse":
                self.reply(400, b'{"error": "refused"}', "application/json")
                return
            time.sleep(600)

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
