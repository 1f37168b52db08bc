#!/bin/bash
# Starts `vllm serve` with the delta-sync engine on the Space's port.
#   MODEL_ID                    model to serve (Hub id or path); required
#   DELTA_SYNC_ALLOWED_BUCKETS  buckets the server may load weights from; required
#   DELTA_SYNC_API_TOKEN        token the weight-update routes require (a secret); required
#   DELTA_SYNC_VERIFY_KEY       the trainer's public key (PEM): only signed versions are applied
#   DELTA_SYNC_FOLLOW           a bucket URL: run `delta-sync follow` beside the server
#   DELTA_SYNC_FOLLOW_INTERVAL  seconds between its polls (default 5)
#   VLLM_EXTRA_ARGS             more `vllm serve` arguments, e.g. "--max-model-len 4096", split
#                               as a shell would (quotes keep an argument with spaces whole)
set -euo pipefail
: "${MODEL_ID:?set the MODEL_ID variable of the Space}"
: "${DELTA_SYNC_ALLOWED_BUCKETS:?set the DELTA_SYNC_ALLOWED_BUCKETS variable of the Space}"
: "${DELTA_SYNC_API_TOKEN:?set the DELTA_SYNC_API_TOKEN secret of the Space}"
export VLLM_SERVER_DEV_MODE=1

# VLLM_EXTRA_ARGS as an array, split by shlex (never by the shell: nothing in it is run).
extra_args=()
if [ -n "${VLLM_EXTRA_ARGS:-}" ]; then
    python3 -c 'import os, shlex; shlex.split(os.environ["VLLM_EXTRA_ARGS"])' \
        || { echo "start.sh: VLLM_EXTRA_ARGS does not split into arguments (unbalanced quotes?)" >&2; exit 2; }
    mapfile -d '' -t extra_args < <(python3 -c \
        'import os, shlex, sys; sys.stdout.write("".join(a + "\0" for a in shlex.split(os.environ["VLLM_EXTRA_ARGS"])))')
fi

# vLLM's CPU workers exchange tensors through /dev/shm; a container's default (64 MiB) is
# too small (`--shm-size=2g` on `docker run` / `podman run`).
shm_kib=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}' || true)
if [ -n "$shm_kib" ] && [ "$shm_kib" -lt 1048576 ]; then
    echo "start.sh: warning: /dev/shm has $((shm_kib / 1024)) MiB free; vLLM may need more (run the container with --shm-size=2g)" >&2
fi

serve() {
    exec python3 -m vllm.entrypoints.openai.api_server \
        --model "$MODEL_ID" \
        --host 0.0.0.0 \
        --port "${PORT:-7860}" \
        --middleware vllm_ext.auth.WeightRouteAuthMiddleware \
        --worker-extension-cls vllm_ext.DeltaWorkerExtension \
        --weight-transfer-config '{"backend": "delta"}' \
        --logprobs-mode processed_logprobs \
        "${extra_args[@]}"
}

[ -n "${DELTA_SYNC_FOLLOW:-}" ] || serve

# Follow mode: the server converges on the bucket with no request from the trainer.
serve &
server=$!
python3 -m delta_sync.cli follow "$DELTA_SYNC_FOLLOW" --vllm-url "http://127.0.0.1:${PORT:-7860}" \
    --interval "${DELTA_SYNC_FOLLOW_INTERVAL:-5}" --max-backoff 30 &
follower=$!
trap 'kill -TERM "$server" "$follower" 2>/dev/null || true' TERM INT
status=0
wait "$server" || status=$?
# A signal ends `wait` before the server has exited: wait until it has.
while kill -0 "$server" 2>/dev/null; do status=0; wait "$server" || status=$?; done
kill -TERM "$follower" 2>/dev/null || true
wait "$follower" || true
exit "$status"
