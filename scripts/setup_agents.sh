#!/usr/bin/env bash
# Install the coding-agent CLIs whose traffic deltaserve must accept (Claude Code, Codex CLI, Qwen Code,
# opencode), at pinned versions, to record what they send (`python -m deltaserve.bench.capture`) and to
# drive them against a running server. Test and benchmark only: nothing here is a dependency of deltaserve.
#
# Usage: scripts/setup_agents.sh [DIR]
#   DIR defaults to $DELTASERVE_HOME/agents ($DELTASERVE_HOME defaults to ~/.cache/deltaserve). The
#   packages go into DIR/node_modules (npm's --prefix), their commands into DIR/node_modules/.bin.
#   Skipped when DIR/installed.txt names exactly the pinned versions below. Prints one line per CLI:
#   "name command executable", command being what to run (DIR/node_modules/.bin/name) and executable the
#   file that runs (the native binary, or the JS bundle for Qwen Code).
#
# Claude Code, Codex and opencode ship native executables in per-platform optional packages
# (@anthropic-ai/claude-code-linux-x64, @openai/codex@<v>-linux-x64, opencode-linux-x64[-baseline]), so
# --omit=optional must not be used; Claude Code and opencode copy theirs into place in a postinstall script.
# Qwen Code and Claude Code declare node >= 22, yet both run on node 20 (Claude Code's command is the
# native binary; Qwen Code's bundle only warns), so engine checks are left non-strict.
set -euo pipefail

HOME_DIR=${DELTASERVE_HOME:-$HOME/.cache/deltaserve}
DIR=${1:-$HOME_DIR/agents}
PACKAGES=(
  "@anthropic-ai/claude-code@2.1.328"
  "@openai/codex@0.169.0"
  "@qwen-code/qwen-code@0.24.4"
  "opencode-ai@1.18.33"
)
BIN="$DIR/node_modules/.bin"
STAMP="$DIR/installed.txt"

log() { echo "[setup_agents] $*" >&2; }

NATIVE_CODEX="$DIR/node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"

report() {
  for name in claude codex qwen opencode; do
    exe=$(readlink -f "$BIN/$name")
    # codex's command is a JS launcher (it puts its bundled rg on PATH) in front of the native binary
    [ "$name" = codex ] && [ -x "$NATIVE_CODEX" ] && exe=$NATIVE_CODEX
    echo "$name $BIN/$name $exe"
  done
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(printf '%s\n' "${PACKAGES[@]}")" ]; then
  log "already installed in $DIR"
  report
  exit 0
fi
command -v npm >/dev/null 2>&1 || { log "npm missing (apt-get install nodejs npm, or a node tarball)"; exit 1; }

mkdir -p "$DIR"
# a private package.json keeps npm from walking up into some enclosing project
[ -f "$DIR/package.json" ] || echo '{"name": "deltaserve-agents", "private": true}' >"$DIR/package.json"
log "installing ${PACKAGES[*]} into $DIR (about 1.3 GB; log $DIR/npm.log)"
npm install --prefix "$DIR" --no-audit --no-fund --save-exact "${PACKAGES[@]}" >"$DIR/npm.log" 2>&1 \
  || { tail -30 "$DIR/npm.log" >&2; exit 1; }

# Qwen Code's tarball ships its bundled ripgrep without the executable bit (it then falls back to a slower
# built-in grep and says so on every run)
find "$DIR/node_modules/@qwen-code/qwen-code/vendor" -type f -name rg -exec chmod +x {} + 2>/dev/null || true

# a package whose postinstall could not place its native binary leaves a stub that fails on first use:
# catch it here rather than in the middle of a capture
for name in claude codex qwen opencode; do
  "$BIN/$name" --version >/dev/null 2>&1 || { log "$name does not run: $BIN/$name --version"; exit 1; }
done
printf '%s\n' "${PACKAGES[@]}" >"$STAMP"
report
