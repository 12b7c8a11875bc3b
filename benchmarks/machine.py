"""The machine a measurement ran on, read from the machine: one line for docs/results.md.

    python benchmarks/machine.py
    # x86_64, AMD EPYC (VM), 2 cores, AVX-512 (torch capability AVX512), 23.5 GiB, torch 2.13.0+cpu, load 7.1 7.3 5.2

The vector instruction set is the widest the CPU flags report (/proc/cpuinfo: avx512f, then avx2), next to the
kernels torch picks (`torch.backends.cpu.get_cpu_capability()`): boxes of one kind differ in it, so a figure
quotes the line of its own box.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

ISA = (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("asimd", "NEON"))  # widest first


def cpuinfo(text: str) -> dict[str, str]:
    """The first processor's fields of a /proc/cpuinfo text."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def vector_isa(flags: str) -> str:
    present = set(flags.split())
    return next((name for flag, name in ISA if flag in present), "none of " + "/".join(n for _, n in ISA))


def describe(cpuinfo_text: str, meminfo_text: str, cores: int, torch_line: str = "") -> str:
    info = cpuinfo(cpuinfo_text)
    model = info.get("model name") or platform.processor() or "unknown CPU"
    hypervisor = " (VM)" if "hypervisor" in info.get("flags", "").split() else ""
    flags = info.get("flags") or info.get("Features", "")
    mem = next((line.split()[1] for line in meminfo_text.splitlines() if line.startswith("MemTotal:")), None)
    parts = [platform.machine(), f"{model}{hypervisor}", f"{cores} cores", vector_isa(flags) + torch_line]
    if mem is not None:
        parts.append(f"{int(mem) / 2**20:.1f} GiB")
    return ", ".join(parts)


def main() -> None:
    read = lambda path: Path(path).read_text() if Path(path).exists() else ""  # noqa: E731
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
    torch_line, torch_version = "", "no torch"
    try:
        import torch

        torch_line = f" (torch capability {torch.backends.cpu.get_cpu_capability()})"
        torch_version = f"torch {torch.__version__}"
    except ImportError:
        pass
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{describe(read('/proc/cpuinfo'), read('/proc/meminfo'), cores, torch_line)}, {torch_version}, load {load}")


if __name__ == "__main__":
    main()
