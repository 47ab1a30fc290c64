#!/bin/bash
# Seconds from `collab serve` (make run's defaults: engine auto, trainer child on) to the page's
# first answer, in one fresh COLLAB_HOME, several starts one after the other. Each start gets its
# own fresh TMPDIR: what a reboot (or a Space's restart) does to /tmp.
#   usage: [SERVE_ARGS=...] serve_starts.sh TREE LABEL STARTS [install|keep]
#   TREE: the checkout to run; LABEL names the outputs under $OUT (default /tmp/serve-starts);
#   install: run `collab models` first, as `make install` does (calibration and the engine race,
#   which fills the compile cache), instead of copying this machine's calibration into the home;
#   keep: start in the home an earlier run of this LABEL left (e.g. SERVE_ARGS="--vllm-compile on"
#   after an install whose race chose eager vLLM).
# Run alone (nothing else on the cores); prints RESULT lines and the log lines that say what the
# engine did (a warm-up, vLLM's init, an AOT load or compile).
set -u
TREE=$1; LABEL=$2; STARTS=${3:-2}; MODE=${4:-copy}
OUT=${OUT:-/tmp/serve-starts}; PY=${PY:-$TREE/.venv/bin/python}; PORT=${PORT:-7931}
H=$OUT/home-$LABEL; rm -rf "$OUT"/tmp-$LABEL-*
[ "$MODE" = keep ] || { rm -rf "$H"; mkdir -p "$H"; }
export COLLAB_HOME=$H COLLAB_MODEL=${COLLAB_MODEL:-$HOME/.cache/collab/models/smollm2-135m-instruct}
export GRADIO_ANALYTICS_ENABLED=False PYTHONPATH=$TREE
unset TORCHINDUCTOR_CACHE_DIR VLLM_CACHE_ROOT
cd "$TREE"
if [ "$MODE" = install ]; then
  t0=$(date +%s.%N); echo "== $LABEL collab models $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  TMPDIR=$(mktemp -d "$OUT/tmp-$LABEL-models-XXXX") "$PY" -m collab_app.cli models > "$OUT/models-$LABEL.log" 2>&1
  echo "RESULT $LABEL collab_models_s $(echo "$(date +%s.%N) - $t0" | bc)"
elif [ "$MODE" = copy ]; then
  cp "$HOME/.cache/collab/calibration.json" "$H/"
fi
for n in $(seq 1 "$STARTS"); do
  T=$OUT/tmp-$LABEL-$n; mkdir -p "$T"
  t0=$(date +%s.%N); echo "== $LABEL start $n $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  TMPDIR=$T setsid "$PY" -m collab_app.web.serve --port "$PORT" ${SERVE_ARGS:-} > "$OUT/serve-$LABEL-$n.log" 2>&1 &
  pid=$!
  until curl -sf -o /dev/null "http://127.0.0.1:$PORT/"; do sleep 0.5; kill -0 $pid 2>/dev/null || { echo died; break; }; done
  echo "RESULT $LABEL start $n page_up_s $(echo "$(date +%s.%N) - $t0" | bc)"
  grep -hE "init engine|AOT|Compiling model again|warm-up|engine: " "$OUT/serve-$LABEL-$n.log" | sed 's/^.*\] //' | cut -c1-170
  kill -TERM -- -$pid; wait $pid 2>/dev/null; sleep 3
done
du -sh "$H/compiled" 2>/dev/null
