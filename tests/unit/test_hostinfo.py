from __future__ import annotations

import platform
from pathlib import Path

from dspark_sglang.hostinfo import cpu_fields, cpu_model, cpu_vendor, host_facts, usable_cpus

TWO_CPUS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu avx2 avx512f

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu avx2 avx512f
"""


def test_reads_the_first_processors_block(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(TWO_CPUS.replace("Processor\nflags", "Processor 8480\nflags", 1))
    fields = cpu_fields(str(info))
    assert fields["processor"] == "0"
    assert fields["flags"].split() == ["fpu", "avx2", "avx512f"]
    assert cpu_model(str(info)) == "Intel(R) Xeon(R) Processor 8480"
    assert cpu_vendor(str(info)) == "GenuineIntel"


def test_the_model_carries_family_and_model_numbers(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n"
        "model name\t: AMD EPYC\n"
    )
    assert cpu_model(str(info)) == "AMD EPYC (family 25 model 1)"


def test_a_missing_cpuinfo_falls_back_to_the_architecture(tmp_path: Path) -> None:
    absent = str(tmp_path / "absent")
    assert cpu_fields(absent) == {}
    assert cpu_vendor(absent) == ""
    assert cpu_model(absent) == (platform.processor() or platform.machine() or "unknown cpu")


def test_host_facts_name_the_cpu_and_versions(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9B45\n")
    facts = host_facts(str(info))
    assert facts["cpu"] == "AMD EPYC 9B45" and facts["vendor"] == "AuthenticAMD"
    assert facts["usable_cpus"] == usable_cpus() >= 1
    assert facts["python"] == platform.python_version()
    assert facts["torch"] is not None  # installed with the package
