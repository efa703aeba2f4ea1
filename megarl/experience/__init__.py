"""The experience record and its plumbing.

- ``schema``: facts / derived tensors, log-probs with producer metadata, reward records;
- ``seal``: read-only sealing, content hash, safetensors + JSON manifest;
- ``join``: idempotent join of role results by id;
- ``packing``: padded <-> packed (cu_seqlens) layouts;
- ``groups``: the GRPO group completion policy.
"""
