"""Training a reward model on preference pairs (``python -m megarl.train_rm``): the loop, apart from
the RL iteration of :mod:`megarl.control`."""
