"""The CPU a benchmark report names (kvops/bench/compare.py): a VM's model name can be only "AMD EPYC", so the
report adds family/model/stepping and the vector features that decide fp32 and bf16 matmul speed."""

from __future__ import annotations

from kvops.bench.compare import cpu_identity, describe_cpu, machine

# The first processor of /proc/cpuinfo on the 2-vCPU VM of 2026-12-05 (flags cut to a few), then a second one.
ZEN3_VM = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu sse2 avx fma avx2 bmi2 sha_ni

processor\t: 1
model name\t: something else
"""
XEON = """processor\t: 0
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
stepping\t: 8
flags\t\t: avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile
"""


def test_the_generation_and_features_are_named_where_the_model_name_is_not():
    zen3 = cpu_identity(ZEN3_VM)
    assert zen3 == {"cpu": "AMD EPYC", "cpu_id": "family 25 model 1 stepping 1", "cpu_features": ["avx2", "fma"]}
    assert describe_cpu({**zen3, "cores": 2}) == "AMD EPYC (family 25 model 1 stepping 1; avx2, fma)"
    xeon = cpu_identity(XEON)
    assert xeon["cpu_features"] == ["avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"]
    assert xeon["cpu_id"] == "family 6 model 143 stepping 8"


def test_a_report_from_before_or_a_machine_without_cpuinfo_still_reads():
    assert describe_cpu({"cpu": "AMD EPYC", "cores": 2}) == "AMD EPYC"
    assert cpu_identity("")["cpu_id"] is None
    here = machine()
    assert here["cpu"] and here["cores"] >= 1 and isinstance(here["cpu_features"], list)
