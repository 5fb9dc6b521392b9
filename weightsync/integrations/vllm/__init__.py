"""vLLM's weight-transfer plugin: a running vLLM engine as a weightsync worker (placeholder, replaced by the lead)."""


def register() -> None:
    """Placeholder replaced by the lead."""
