"""Tensors: how weights leave a model and go back (strategy), where they sit in one buffer (layout), a model
bound to such a buffer (bound), and copies between them (copies)."""
