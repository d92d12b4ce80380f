"""Headless Chromium (Debian's `chromium` package) over a folder bucket served on 127.0.0.1.

The bucket is served as a static website, as people would serve it; a small checker page on
the same origin loads dashboard/index.html in a frame and, once the frame has loaded (with
its images, and the page's own script has run), writes what it found as JSON into its own
DOM, which `--dump-dom` prints: the images, the fleet table's ids and `seen` cells, whether
the page reloads itself, and its text as shown.
"""
from __future__ import annotations

import html
import http.server
import json
import re
import shutil
import subprocess
import threading
from functools import partial
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]
CHECKER = b"""<!doctype html><html><body><pre id="out">pending</pre>
<iframe id="f" src="/dashboard/index.html" width="1200" height="2400"></iframe>
<script>
document.getElementById('f').onload = function () {
  const d = this.contentDocument;
  const images = [...d.images].map(i => ({src: i.getAttribute('src'),
                                          loaded: i.complete && i.naturalWidth > 0}));
  const volunteers = [...d.querySelectorAll('table tr')].slice(1).map(r => r.cells[0].textContent);
  const refresh = d.querySelector('meta[http-equiv="refresh"]') !== null;
  const seen = [...d.querySelectorAll('table tr')].slice(1).map(r => r.cells[2].textContent);
  const text = d.body.innerText;  // as shown: hidden elements left out, the script's ages in
  document.getElementById('out').textContent = JSON.stringify({images, volunteers, refresh, seen, text});
};
</script></body></html>"""


class _Handler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/__check.html":
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(CHECKER)))
            self.end_headers()
            self.wfile.write(CHECKER)
            return
        super().do_GET()

    def log_message(self, *args):  # keep test output clean
        pass


def serve(folder: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_Handler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _chromium(profile: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=120)


def inspect_dashboard(bucket: Path, work: Path, screenshot: Path) -> dict:
    """{'images': [{src, loaded}], 'volunteers': [...], 'seen': [...], 'refresh': bool,
    'text': str} as Chromium saw the page; also saves a screenshot of it."""
    server, base = serve(bucket)
    try:
        out = _chromium(work / "profile", "--virtual-time-budget=15000", "--dump-dom",
                        f"{base}/__check.html")
        found = re.search(r'<pre id="out">(.*?)</pre>', out.stdout, re.S)
        assert found and found.group(1) != "pending", out.stdout[-2000:] + out.stderr[-2000:]
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        _chromium(work / "profile2", "--window-size=1280,2600", f"--screenshot={screenshot}",
                  f"{base}/dashboard/index.html")
        return json.loads(html.unescape(found.group(1)))
    finally:
        server.shutdown()
