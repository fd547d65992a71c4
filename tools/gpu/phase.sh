# Sourced by the GPU run scripts: results folder, bench command, and `phase NAME SECONDS COMMAND...`, which
# runs one measurement under its own time limit and records its exit code and duration in bench.jsonl.
RES=${RES:-/tmp/res}
mkdir -p "$RES"
OUT="$RES/bench.jsonl"
B="python3 -m tools.gpu.bench_ladder"
phase() {
  local name=$1 limit=$2; shift 2
  echo "=== $(date +%T) $name (limit ${limit}s)"
  local start=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "{\"kind\": \"phase\", \"name\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - start))}" >> "$OUT"
  echo "=== $(date +%T) $name rc=$rc in $((SECONDS - start))s"
}
