"""The experience record and its plumbing.

- ``schema``: facts / derived tensors, log-probs with producer metadata, reward records;
- ``seal``: read-only sealing, content hash, safetensors + JSON manifest;
- ``packing``: padded <-> packed (cu_seqlens) layouts;
- ``groups``: the GRPO group completion policy.
"""
