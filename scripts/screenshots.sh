#!/usr/bin/env bash
# Screenshots of the documentation site's key pages in headless Chromium, 1400 px wide:
# home, getting started, choosing a method, a method page, a benchmark page.
#   bash scripts/screenshots.sh [OUT_DIR]     (default docs/screenshots)
# Needs chromium (Debian: apt-get install chromium) and the project's venv (mkdocs).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-docs/screenshots}"
PY="${PYTHON:-.venv/bin/python}"
CHROMIUM="${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}"
if [ -z "$CHROMIUM" ]; then
  echo "screenshots: chromium not found (apt-get install chromium)" >&2
  exit 3
fi
WORK="$(mktemp -d)"
SERVER_PID=""
cleanup() { [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT
NO_MKDOCS_2_WARNING=1 "$PY" -m mkdocs build --strict --quiet --site-dir "$WORK/site"
PORT="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$PY" -m http.server "$PORT" --bind 127.0.0.1 --directory "$WORK/site" >/dev/null 2>&1 &
SERVER_PID=$!
for _ in $(seq 50); do
  "$PY" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/')" 2>/dev/null && break
  sleep 0.2
done
mkdir -p "$OUT"
# name  path  height
while read -r name path height; do
  timeout 120 "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-background-networking \
    --disable-component-update --disable-sync --no-first-run --hide-scrollbars \
    --user-data-dir="$WORK/profile-$name" --window-size="1400,$height" \
    --screenshot="$OUT/$name.png" "http://127.0.0.1:$PORT/$path" >/dev/null 2>&1
  echo "$OUT/$name.png"
done <<'PAGES'
home              .                          1800
getting-started   docs/getting-started/      1800
choosing          docs/choosing/             2200
method-oktopk     docs/methods/oktopk/       1800
benchmark-convergence benchmarks/convergence/ 2200
PAGES
