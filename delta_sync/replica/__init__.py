"""The replica side: applying a bucket's anchors and deltas to weights held locally.

| module | what it holds |
| --- | --- |
| `receiver` | [`Receiver`]: download, verify and apply a version, all or nothing |
| `verify` | [`verify_bucket`]: replay a whole bucket as a fresh replica would |

Nothing here imports the training stack: it runs inside a vLLM server's environment.
"""
