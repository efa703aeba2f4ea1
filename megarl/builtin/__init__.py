"""The built-in assets of the embedded default: what a fresh clone trains on with no download.

* :mod:`~megarl.builtin.tiny_tokenizer` -- the word-level tokenizer (digits are single tokens)
  and its chat template;
* :mod:`~megarl.builtin.tiny_checkpoint` -- a small random HF checkpoint of a supported family;
* :mod:`~megarl.builtin.warmstart` -- the program that builds the tiny model: both of the above,
  then a supervised warm start through the megatron actor, early-stopped on a validation set
  (``python -m megarl.tinymodel``).

The arithmetic task itself is data (:mod:`megarl.data.tasks.arithmetic`).
"""
