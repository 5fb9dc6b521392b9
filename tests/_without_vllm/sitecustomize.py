"""Put on ``PYTHONPATH`` of the processes TorchRL's collectors start in ``tests/test_torchrl.py``: vLLM is hidden from
them, as if it were not installed.

TorchRL 0.14.1 imports vLLM (and ``transformers`` with it) at ``import torchrl.collectors`` whenever it is installed,
for LLM classes no collector of these tests uses: 8.4 s of each process's start here against 3.3 s without, and each
collector worker is a spawned process that pays it. TorchRL's own fallback for a machine without vLLM takes over
(``find_spec("vllm")`` is ``None``; its ``from vllm ...`` imports raise ``ImportError``). The docs' TorchRL commands
and ``examples/`` still run with vLLM in view, as a user's do.
"""

import sys

sys.modules.setdefault("vllm", None)  # type: ignore[assignment]
