"""Open a Chrome trace in a real trace viewer, offline: Catapult's trace viewer (the engine of
`chrome://tracing`), as shipped in the `xprof` wheel on PyPI, loaded in headless Chromium.

    .venv/bin/python -m tests.traceview TRACE.json [SHOT.png]
    .venv/bin/python -m tests.traceview --fetch

`fetch()` downloads the wheel once (pinned) and keeps only the viewer's two files under
~/.cache/argus/traceview/ (or $ARGUS_TRACEVIEW_CACHE); `render()` builds a page that imports the
trace with the viewer's own importer (`tr.importer.Import`), shows it in its timeline view, and
writes what the viewer's model holds (processes, thread tracks, slices per track, import
warnings) into the page, read back with `--dump-dom`; `--screenshot` takes the picture.
"""

from __future__ import annotations

import html
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional

XPROF = "xprof==2.24.2"
FILES = ("trace_viewer_index.html", "trace_viewer_index.js")
BROWSER = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]

# Runs after the viewer's script: import, show, and say what the model holds.
LOADER = """<pre id="argus-model">loading</pre>
<script src="trace_viewer_index.js"></script>
<script src="trace-data.js"></script>
<script>
'use strict';
function say(s) { document.getElementById('argus-model').textContent = s; }
function show() {
  try {
    const model = new tr.Model();
    new tr.importer.Import(model).importTraces([window.ARGUS_TRACE]);
    const procs = model.getAllProcesses().map(p => ({
      pid: p.pid, name: p.name || '',
      threads: Object.values(p.threads).map(
        t => ({tid: t.tid, name: t.name || '', slices: t.sliceGroup.length})),
    }));
    const container = document.createElement('track-view-container');
    container.id = 'track_view_container';
    const viewer = document.createElement('tr-ui-timeline-view');
    viewer.track_view_container = container;
    Polymer.dom(viewer).appendChild(container);
    viewer.globalMode = true;
    viewer.style.height = '100vh';
    Polymer.dom(document.body).appendChild(viewer);
    viewer.model = model;
    document.getElementById('argus-model').style.display = 'none';
    say(JSON.stringify({processes: procs, warnings: model.importWarnings.map(w => w.message)}));
  } catch (e) { say(JSON.stringify({error: String(e)})); }
}
if (window.Polymer && window.tr) setTimeout(show, 0);
else document.addEventListener('WebComponentsReady', show);
</script></body></html>"""


def cache_dir() -> Path:
    base = os.environ.get("ARGUS_TRACEVIEW_CACHE") or str(Path.home() / ".cache" / "argus" / "traceview")
    return Path(base) / XPROF.replace("==", "-")


def fetch(python: str = sys.executable) -> Optional[str]:
    """Make sure the viewer's files are cached; None when they are, else why not."""
    d = cache_dir()
    if all((d / f).is_file() for f in FILES):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run(
            [python, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, XPROF],
            capture_output=True,
            text=True,
            timeout=600,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if res.returncode != 0 or not wheels:
            return f"pip download {XPROF} failed: {(res.stderr or res.stdout).strip()[-300:]}"
        d.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as z:
            for f in FILES:
                (d / f).write_bytes(z.read(f"xprof/static/{f}"))
    return None


def missing() -> Optional[str]:
    """Why the viewer cannot run here, or None."""
    if shutil.which("chromium") is None:
        return "no chromium (scripts/setup.sh installs it)"
    if not all((cache_dir() / f).is_file() for f in FILES):
        return f"the trace viewer is not cached at {cache_dir()} (scripts/setup.sh fetches it)"
    return None


def render(trace: Dict[str, Any], shot: Optional[Path] = None, size: str = "1600,1000") -> Dict[str, Any]:
    """What the viewer's model holds after importing `trace`; a screenshot to `shot` if given."""
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "view.html"
        head = (cache_dir() / FILES[0]).read_text().split("<tf-trace-viewer></tf-trace-viewer>")[0]
        page.write_text(head + LOADER)
        shutil.copy(cache_dir() / FILES[1], Path(tmp) / FILES[1])
        (Path(tmp) / "trace-data.js").write_text("window.ARGUS_TRACE = " + json.dumps(trace) + ";\n")
        common = [*BROWSER, "--virtual-time-budget=30000", f"--window-size={size}"]
        dom = subprocess.run(
            [*common, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=300
        )
        start = dom.stdout.find('<pre id="argus-model"')
        if dom.returncode != 0 or start < 0:
            raise RuntimeError(f"chromium failed: {dom.stderr[-1000:]}")
        body = dom.stdout[dom.stdout.index(">", start) + 1 : dom.stdout.index("</pre>", start)]
        out: Dict[str, Any] = {"error": "not loaded"}
        if body != "loading":
            out = json.loads(html.unescape(body))
        if shot is not None:
            res = subprocess.run(
                [*common, f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True, timeout=300
            )
            if res.returncode != 0 or not shot.exists():
                raise RuntimeError(f"chromium screenshot failed: {res.stderr[-1000:]}")
        return out


def tracks(model: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every thread track as {pid, process, tid, name, slices}."""
    return [
        {"pid": p["pid"], "process": p["name"], **t} for p in model.get("processes", []) for t in p["threads"]
    ]


def main() -> int:
    if sys.argv[1:] == ["--fetch"]:
        had = all((cache_dir() / f).is_file() for f in FILES)
        why = fetch()
        if why:
            print(why, file=sys.stderr)
            return 1
        print(f"{'ok' if had else 'fetched'}: trace viewer ({XPROF}) at {cache_dir()}")
        return 0
    if len(sys.argv) not in (2, 3):
        print("usage: python -m tests.traceview TRACE.json [SHOT.png] | --fetch", file=sys.stderr)
        return 2
    why = fetch() or missing()
    if why:
        print(f"ERROR: {why}", file=sys.stderr)
        return 1
    shot = Path(sys.argv[2]) if len(sys.argv) == 3 else None
    model = render(json.loads(Path(sys.argv[1]).read_text()), shot)
    for t in tracks(model):
        print(f"{t['process']:<28} {t['name']:<32} {t['slices']:>7} slices")
    for w in model.get("warnings", []):
        print(f"warning: {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
