#!/usr/bin/env bash
# Linux-side check of every Metal source in the repository: the translation-layer rules plus a
# syntax/type check with a C++17 compiler (clang++, else g++) and the shim in kb/metal-shim/.
#
# - whole Metal files (*.metal declaring a [[kernel]]) and MLX metal_kernel bodies
#   (tasks/*/mlx/*.metal; their signature comes from the task.toml, or `// inputs:` comments);
# - files under a `reject/` directory (kb/examples/reject/) must be REJECTED, all others accepted.
#
# Uses `ksearch kb check --syntax` when the binary ($KSEARCH_BIN, default target/release/ksearch;
# build it first) has the `kb` subcommand; otherwise the same
# scan runs as the kb crate's test `cargo test -p ksearch-kb --test metal_files`.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v clang++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1 && [ -z "${KSEARCH_CXX:-}" ]; then
  echo "check-metal: no C++ compiler (install clang or g++)" >&2
  exit 2
fi

bin="${KSEARCH_BIN:-target/release/ksearch}"
if [ ! -x "$bin" ] || ! "$bin" kb --help >/dev/null 2>&1; then
  echo "check-metal: no \`ksearch kb\`; running the kb crate's scan instead"
  exec cargo test -q --release -p ksearch-kb --test metal_files
fi

export KSEARCH_KB="${KSEARCH_KB:-$PWD/kb}"
fail=0
n=0
while IFS= read -r f; do
  n=$((n + 1))
  set +e
  out="$("$bin" kb check --syntax --target generic-apple "$f" 2>&1)"
  rc=$?
  set -e
  case "$f" in
    */reject/*) want=1 ;;
    *) want=0 ;;
  esac
  if [ "$rc" -ne "$want" ]; then
    echo "FAIL $f (exit $rc, expected $want)"
    echo "$out" | sed 's/^/    /'
    fail=1
  else
    echo "ok   $f$([ "$want" = 1 ] && echo ' (rejected as expected)')"
  fi
done < <(find . -name '*.metal' -not -path './target/*' -not -path './.git/*' | sed 's|^\./||' | sort)

echo "check-metal: $n file(s) checked"
exit "$fail"
