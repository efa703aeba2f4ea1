"""The experience record and its plumbing.

- ``schema``: facts / derived tensors, log-probs with producer metadata, reward records;
- ``seal``: read-only sealing, content hash, safetensors + JSON manifest;
- ``origins``: per-token source / turn / policy version of multi-turn (agent) trajectories;
- ``packing``: padded <-> packed (cu_seqlens) layouts;
- ``groups``: the GRPO group completion policy.
"""
