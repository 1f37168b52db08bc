#!/bin/sh
# Starts `vllm serve` with the delta-sync engine on the Space's port.
#   MODEL_ID                    model to serve (Hub id or path); required
#   DELTA_SYNC_ALLOWED_BUCKETS  buckets the server may load weights from; required
#   VLLM_EXTRA_ARGS             more `vllm serve` arguments, e.g. "--max-model-len 4096"
set -eu
: "${MODEL_ID:?set the MODEL_ID variable of the Space}"
: "${DELTA_SYNC_ALLOWED_BUCKETS:?set the DELTA_SYNC_ALLOWED_BUCKETS variable of the Space}"
export VLLM_SERVER_DEV_MODE=1
# shellcheck disable=SC2086  # VLLM_EXTRA_ARGS is a list of arguments
exec python3 -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_ID" \
    --host 0.0.0.0 \
    --port "${PORT:-7860}" \
    --worker-extension-cls vllm_ext.DeltaWorkerExtension \
    --weight-transfer-config '{"backend": "delta"}' \
    --logprobs-mode processed_logprobs \
    ${VLLM_EXTRA_ARGS:-}
