"""Which matmul kernel each precision takes on this processor.

A CPU either has dot-product instructions for a 16-bit type (AVX512-BF16 or AMX-BF16 for BF16;
AVX512-FP16 or AMX-FP16 for FP16), which oneDNN uses, or it has not, and then PyTorch's native
kernel for that type converts element by element and runs 5-50x slower than FP32 (measured in
docs/benchmarks.md). Without the instructions, Parity runs the FP32 kernel on the inputs rounded
to the precision and rounds the output: the same semantics (rounded inputs, FP32 accumulation,
rounded output) at FP32 speed, and the same arithmetic a GPU's tensor cores do.

oneDNN obeys ONEDNN_MAX_CPU_ISA (formerly DNNL_MAX_CPU_ISA), which can forbid instructions the
processor has; the choice follows what oneDNN may use, not only what the processor reports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import torch

# oneDNN ISA names (ONEDNN_MAX_CPU_ISA) that allow its BF16 / FP16 dot-product kernels. "ALL" and
# "DEFAULT" set no limit; every name not listed (SSE41 ... AVX512_CORE_VNNI) forbids them.
BF16_ISAS = {
    "AVX512_CORE_BF16",
    "AVX512_CORE_FP16",
    "AVX10_1_512",
    "AVX512_CORE_AMX",
    "AVX10_1_512_AMX",
    "AVX512_CORE_AMX_FP16",
    "AVX10_1_512_AMX_FP16",
    "ALL",
    "DEFAULT",
}
FP16_ISAS = {"AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "ALL", "DEFAULT"}

NATIVE = "native"
EMULATED = "fp32-kernel-on-rounded-inputs"


def cpu_flags() -> set[str]:
    """The processor's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@dataclass(frozen=True)
class CpuFeatures:
    capability: str  # torch.backends.cpu.get_cpu_capability(): what ATen's vector kernels use
    onednn_isa: str | None  # ONEDNN_MAX_CPU_ISA, upper-cased; None = no limit
    bf16_dot: bool  # the processor has BF16 dot products (avx512_bf16 or amx_bf16)
    fp16_dot: bool  # the processor has FP16 dot products (avx512_fp16 or amx_fp16)

    @classmethod
    def read(cls) -> CpuFeatures:
        flags = cpu_flags()
        isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
        return cls(
            capability=torch.backends.cpu.get_cpu_capability(),
            onednn_isa=isa.upper() if isa else None,
            bf16_dot=torch.cpu._is_avx512_bf16_supported() or "amx_bf16" in flags,
            fp16_dot=torch.cpu._is_amx_fp16_supported() or "avx512_fp16" in flags,
        )

    def native(self, dtype: torch.dtype) -> bool:
        """Whether `dtype`'s matmuls take PyTorch's native kernel (else: FP32 on rounded inputs)."""
        if dtype == torch.float32:
            return True
        allowed, has = {torch.bfloat16: (BF16_ISAS, self.bf16_dot), torch.float16: (FP16_ISAS, self.fp16_dot)}[dtype]
        return has and (self.onednn_isa is None or self.onednn_isa in allowed)

    def describe(self) -> dict[str, str]:
        return {
            "cpu_capability": self.capability,
            "onednn_max_cpu_isa": self.onednn_isa or "unset",
            "cpu_bf16_dot_product": str(self.bf16_dot).lower(),
            "cpu_fp16_dot_product": str(self.fp16_dot).lower(),
        }


@cache
def features() -> CpuFeatures:
    """This process's CPU features, read once (the kernel choice cannot change mid-run)."""
    return CpuFeatures.read()


# PARITY_CPU_KERNELS=native|emulated overrides the choice for both 16-bit precisions (auto: by features).
OVERRIDE_ENV = "PARITY_CPU_KERNELS"


@cache
def emulated_dtypes() -> frozenset[torch.dtype]:
    """The 16-bit dtypes whose matmuls run the FP32 kernel on rounded inputs on this CPU."""
    override = os.environ.get(OVERRIDE_ENV, "auto")
    if override not in ("auto", "native", "emulated"):
        raise ValueError(f"{OVERRIDE_ENV}={override!r}: expected auto, native or emulated")
    if override != "auto":
        return frozenset() if override == "native" else frozenset({torch.bfloat16, torch.float16})
    return frozenset(d for d in (torch.bfloat16, torch.float16) if not features().native(d))
