"""The trainer side: change detection, publishing, and the integrations that drive them.

| module | what it holds |
| --- | --- |
| `detector` | [`BF16ChangeDetector`]: exactly which bf16 elements an optimizer step changed |
| `checkpoint` | [`CheckpointLayout`]: where each checkpoint tensor (as `save_pretrained` writes it) lies in the run-time parameters, from transformers' own conversion mapping |
| `publisher` | [`Publisher`] and its [`PublisherOptions`]: anchors, deltas and `latest.json` written to a bucket |
| `schedule` | [`AnchorSchedule`]: which versions are anchors, by count and by bytes (no I/O) |
| `writer` | [`VersionWriter`]: encodes, uploads and points `latest.json` at each version, on the thread that writes |
| `lease` | [`SnapshotLease`]: the hold on the detector's snapshot while a version is encoded |
| `ranks` | [`RankGroup`]: the few collectives of a sharded trainer's publishers |
| `callback` | [`DeltaSyncCallback`]: the two above as a `transformers.TrainerCallback` |
| `replicas` | [`ReplicaSet`]: tells vLLM replicas about each new version over HTTP, through `delta_sync.control.client.Replica` |
| `trl_vllm` | the one patch of TRL: its vLLM server mode syncs through the callback |

Only `callback` and `trl_vllm` import transformers or TRL, and only when imported;
`checkpoint` uses transformers' conversion API only for a model that is a transformers model.
"""
