"""Put on PYTHONPATH by tests/integrations/test_vllm_lora.py for every vLLM process: ask Linux
for AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``). vLLM 0.32's CPU
attention kernel uses AMX on processors that have it without asking, and dies of SIGILL when
nothing in the process asked first (oneDNN's matmuls do, unless LoRA layers replace them).
Harmless elsewhere: the call fails with EINVAL and nothing changes."""

import contextlib
import ctypes
import platform
import sys

if sys.platform == "linux" and platform.machine() == "x86_64":
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).syscall(158, 0x1023, 18)  # SYS_arch_prctl
