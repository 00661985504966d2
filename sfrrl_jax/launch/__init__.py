"""The launch layer: the `sfrrl-train` CLI, gin bindings of the config dataclasses, the experiment runner."""
