"""The main job, ``python -m weightsync``: a Hydra app that syncs, verifies and times."""
