"""Examples to copy from: ``examples/reward_plugin.py`` is a user reward plug-in
(``reward.fn: examples.reward_plugin:boxed_answer``, run from the repository root)."""
