#!/usr/bin/env bash
# One round of the agent-driven attention search (issue 15) in one device call:
#   bash eval/agent/round.sh OUT_DIR [ROUNDS]      (AGENT_DIR: the candidates' folder, default eval/agent)
# A new run on the H200 grid (48 workloads; the root's latencies measured at init), the
# contrastive prompt as the round starts, then every candidate proposed as the agent's:
# $AGENT_DIR/attention_*.py, a source (its module docstring is the note: the hypothesis and the
# predicted gain, written before any timing), and $AGENT_DIR/attention_*.json, a config delta on
# the kernel's knobs ({"note": ..., "delta": {...}}), audited (gate + paired timing, ROUNDS rounds) and promoted
# when the audit allows it; the status, the prompt for the next round and the run directory
# (records, every attempt) come back under OUT_DIR. A kernel default changes only afterwards,
# by hand, citing a promoted audit.
set -u
OUT=${1:?usage: round.sh OUT_DIR [ROUNDS]}
ROUNDS=${2:-5}
RUN=$OUT/attention_run
mkdir -p "$OUT"
tik() { python3 -m areal_tik.cli optimize "$@"; }
DIR=${AGENT_DIR:-eval/agent}
# a round without candidates would only time the root: refuse it before it spends device time
compgen -G "$DIR/attention_*.py" > /dev/null || compgen -G "$DIR/attention_*.json" > /dev/null || {
  echo "round.sh: no candidate in $DIR (attention_*.py sources or attention_*.json deltas)" >&2; exit 2; }
# AGENT_GRID=tiny AGENT_DEVICE=cpu: the same round on the Triton interpreter (the CPU test)
tik init --run "$RUN" --op attention --grid "${AGENT_GRID:-h200}" --device "${AGENT_DEVICE:-cuda}" || exit 1
tik prompt --run "$RUN" --out "$OUT/prompt_round_start.md"
failed=0
for src in "$DIR"/attention_*.py "$DIR"/attention_*.json; do
  [ -e "$src" ] || continue
  if [ "${src##*.}" = py ]; then
    note=$(python3 -c "import ast,sys; print(ast.get_docstring(ast.parse(open(sys.argv[1]).read())).split(chr(10)*2)[0])" "$src")
    cand=$(tik propose --run "$RUN" --source "$src" --proposer agent --note "$(basename "$src"): $note" | tail -n 1)
  else  # {"note": hypothesis and prediction, "delta": a config delta on the root's knobs}
    note=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['note'])" "$src")
    delta=$(python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))['delta']))" "$src")
    # on the root, not the incumbent: an incumbent promoted earlier in the round may be a source
    cand=$(tik propose --run "$RUN" --delta "$delta" --parent root --proposer agent \
           --note "$(basename "$src"): $note" | tail -n 1)
  fi
  echo "== $src -> $cand"
  if [ -z "$cand" ]; then failed=$((failed + 1)); continue; fi
  tik audit --run "$RUN" --rounds "$ROUNDS" "$cand" | tee "$OUT/audit_$cand.json"
  audit=$(python3 -c "import json,sys; a=json.load(open(sys.argv[1])); print(a['audit'] if a['promotable'] else '')" \
          "$OUT/audit_$cand.json")
  [ -n "$audit" ] && tik promote --run "$RUN" "$audit"
done
tik status --run "$RUN" --json > "$OUT/status.json"
tik status --run "$RUN"
tik prompt --run "$RUN" --out "$OUT/prompt_next_round.md"
tar czf "$OUT/attention_run.tgz" -C "$OUT" attention_run && rm -rf "$RUN"
[ "$failed" -eq 0 ] || { echo "round.sh: $failed candidate(s) could not be proposed (above)" >&2; exit 1; }
