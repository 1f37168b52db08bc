"""The trainer side: change detection, publishing, and the integrations that drive them.

| module | what it holds |
| --- | --- |
| `detector` | [`BF16ChangeDetector`]: exactly which bf16 elements an optimizer step changed |
| `mirror` | [`HostMirror`]: a host copy of the detector's device snapshot, kept current from the changes |
| `sharding` | [`describe_model`]: where each rank's parameters sit in the checkpoint tensors (a [`ModelLayout`]), and which layouts can be published |
| `merged` | [`MergedWeights`]: a PEFT model's weights as a replica serves them, the base checkpoint with the adapter merged |
| `options` | [`PublisherOptions`] and [`PeftPublish`]: how versions are stored, for both publishers |
| `publisher` | [`Publisher`]: anchors, deltas and `latest.json` written to a bucket |
| `adapter` | [`AdapterPublisher`]: adapter mode, a PEFT LoRA adapter published whole per version for `vllm serve --enable-lora` |
| `background` | [`BackgroundWriter`]: both publishers' worker thread: versions stored in order, failures kept for the training thread, `latest.json` refreshed while idle |
| `schedule` | [`AnchorSchedule`]: which versions are anchors, by count and by bytes (no I/O) |
| `writer` | [`VersionWriter`]: encodes, uploads and points `latest.json` at each version, on the thread that writes |
| `prefix` | [`PointerWriter`] (signed uploads, `latest.json` under a counter that only increases), and claiming and resuming a run's bucket prefix |
| `lease` | [`SnapshotLease`]: the hold on the detector's snapshot while a version is encoded |
| `ranks` | [`RankGroup`]: the few collectives of a sharded trainer's publishers |
| `callback` | [`DeltaSyncCallback`]: the detector and a publisher as a `transformers.TrainerCallback` |
| `replicas` | [`ReplicaSet`]: tells vLLM replicas about each new version over HTTP, through `delta_sync.control.client.Replica` |
| `trl_vllm` | the one patch of TRL: its vLLM server mode syncs through the callback |

Only `callback` and `trl_vllm` import transformers or TRL, and only when imported.
[`CheckpointLayout`] (where each checkpoint tensor lies in the run-time parameters) is in
`delta_sync.checkpoint`, shared with the replica side.
"""
