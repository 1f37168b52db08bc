"""The trainer side: change detection, publishing, and the integrations that drive them.

| module | what it holds |
| --- | --- |
| `detector` | [`BF16ChangeDetector`]: exactly which bf16 elements an optimizer step changed |
| `publisher` | [`Publisher`]: anchors, deltas and `latest.json` written to a bucket |
| `callback` | [`DeltaSyncCallback`]: the two above as a `transformers.TrainerCallback` |
| `replicas` | [`ReplicaSet`]: tells vLLM replicas about each new version over HTTP |
| `trl_vllm` | the one patch of TRL: its vLLM server mode syncs through the callback |

Only `callback` and `trl_vllm` import transformers or TRL, and only when imported.
"""
