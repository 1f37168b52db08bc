"""The replica side: applying a bucket's anchors and deltas to weights held locally.

| module | what it holds |
| --- | --- |
| `receiver` | [`Receiver`]: download, verify and apply a version, all or nothing |
| `update` | what a receiver reports and keeps of an update: `ApplyResult`, `Prepared`, `PendingUpdate`, `Freshness` |
| `trust` | [`BucketReader`]: which buckets are read, and what is trusted of them (allow list, signatures, size caps) |
| `checks` | a file's header checked against the version held, the model's shapes and `latest.json` |
| `loaders` | the `load_weights` protocols (`WeightPatch`, `PatchingWeightLoader`) and the plain module's loader |
| `pointer` | [`PointerLedger`]: the newest `latest.json` accepted from each bucket (pointers only move forward) |
| `store` | where a receiver keeps the weights it checks: in this process, or shared by the machine |
| `shared` | the machine-shared store: every vLLM worker of a node applies to one snapshot |
| `snapshot` | [`NodeSnapshot`]: that one memory-mapped bf16 snapshot per machine, with undo records |
| `staging` | one update's sparse patches staged for a device in two buffers |
| `prefetch` | [`Prefetcher`]: prepares new versions in a shared snapshot before anyone asks |
| `compiled` | `load_compiled_passes`: the compiled passes loaded before a server serves |
| `follow` | [`Follower`]: keeps a vLLM server at a bucket's newest version (`delta-sync follow`) |
| `adapter` | [`AdapterFetcher`]: adapter-mode versions fetched for vLLM's LoRA loading, trusted as the receiver trusts |
| `verify` | [`verify_bucket`]: replay a whole bucket as a fresh replica would |

Nothing here imports the training stack, nor `delta_sync.trainer`: it runs inside a vLLM
server's environment. `loaders` loads a transformers model through the checkpoint layout the
trainer publishes by, `delta_sync.checkpoint`. The HTTP client `follow` drives a server with
is `delta_sync.control.client`.
"""
