"""The main job's configuration (installed as the package ``weightsync.conf``, for ``pkg://weightsync.conf``)."""
