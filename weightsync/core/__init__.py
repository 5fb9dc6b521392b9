"""The core: the scheme lifecycle, the sender pipeline and the receiver apply path, whatever the engine."""
