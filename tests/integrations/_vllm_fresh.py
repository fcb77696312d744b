"""Run by ``_vllm_run.finish`` in the ``.venv-vllm`` interpreter: a fresh CPU vLLM engine
started from a Hugging Face checkpoint (vLLM's own loader and post-processing), its greedy tokens
and readable parameters saved to ``argv[2]`` (``torch.save``). The reference the deltackpt
engine's commits are compared with.

Its engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here): the
same model code, loader and kernels as a multiprocess engine, without starting and stopping
two more interpreters (~20 s of the suite on 2 cores); the layout of linear weights is the
caller's (``_vllm_linear/`` is inherited through the environment).

Usage: ``.venv-vllm/bin/python tests/integrations/_vllm_fresh.py MODEL_DIR OUT.pt``
"""

from __future__ import annotations

import os
import sys

import torch


def main(model_dir: str, out_path: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from _vllm_run import _readable, _unpack, engine, greedy

    llm = engine(model_dir, transfer=False)
    readable = _unpack(llm.collective_rpc(_readable)[0])
    torch.save({"tokens": greedy(llm), "readable": readable}, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
