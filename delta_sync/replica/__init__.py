"""The replica side: applying a bucket's anchors and deltas to weights held locally.

| module | what it holds |
| --- | --- |
| `receiver` | [`Receiver`]: download, verify and apply a version, all or nothing |
| `store` | where a receiver keeps the weights it checks: in this process, or shared by the machine |
| `shared` | the machine-shared store: every vLLM worker of a node applies to one snapshot |
| `snapshot` | [`NodeSnapshot`]: that one memory-mapped bf16 snapshot per machine, with undo records |
| `follow` | [`Follower`]: keeps a vLLM server at a bucket's newest version (`delta-sync follow`) |
| `verify` | [`verify_bucket`]: replay a whole bucket as a fresh replica would |

Nothing here imports the trainer side or the training stack: it runs inside a vLLM
server's environment. The HTTP client `follow` drives a server with is
`delta_sync.control.client`.
"""
