"""Write the config groups as YAML under a folder (``conf/``), for apps that use ``pkg://weightsync.conf``.

    python -m weightsync.config.export conf

The YAML mirrors the dataclasses exactly; a test fails if they drift apart.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

from .store import SCHEMES, STRATEGIES, TRANSPORTS, composed, serving_vllm

__all__ = ["export", "group_yaml"]

HEADER = "# Generated from weightsync.config by `python -m weightsync.config.export conf`; do not edit.\n"


def group_yaml() -> dict[str, str]:
    """``{"weightsync/scheme/multiprocess.yaml": text, ...}`` for the config of every scheme and transport of
    weightsync's own (an installed package's engines have their configs in the ConfigStore, not in ``conf/``)."""
    out = {}
    groups = (
        ("scheme", {**{name: composed(node) for name, node in SCHEMES.items()}, "vllm": serving_vllm()}),
        ("scheme/transport", TRANSPORTS),
        ("transport", TRANSPORTS),
        ("strategy", STRATEGIES),
    )
    for group, options in groups:
        for name, node in options.items():
            if not getattr(node, "_target_", "weightsync.").startswith("weightsync."):
                continue
            out[f"weightsync/{group}/{name}.yaml"] = HEADER + OmegaConf.to_yaml(OmegaConf.structured(node))
    return out


def export(root: Path) -> None:
    for rel, text in group_yaml().items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


if __name__ == "__main__":
    export(Path(sys.argv[1] if len(sys.argv) > 1 else "conf"))
