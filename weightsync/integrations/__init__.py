"""Integrations: the programs that drive a weightsync scheme themselves, each in a module of its own.

Each module here defines the :class:`~weightsync.core.drivers.Driver` of one program: how to recognize it in a
scheme's context, and what it needs of the scheme. :mod:`weightsync.integrations.torchrl` is TorchRL's
collectors; the vLLM integration (an inference engine as the workers of a scheme) will live beside it. The core
names none of them: it finds them through :mod:`weightsync.registry` (:data:`~weightsync.registry.INTEGRATIONS`,
and the ``weightsync.integrations`` entry-point group for other packages'), on the first scheme given a context.
"""
