"""Every shipped Accelerate config loads with Accelerate's own loader, and every key is explained."""

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

CONFIGS = Path(__file__).resolve().parents[1] / "accelerate_configs"
EXPECTED = {
    "cpu_ddp.yaml": (DistributedType.MULTI_GPU, 2, "no"),
    "single_gpu.yaml": (DistributedType.NO, 1, "bf16"),
    "multi_gpu.yaml": (DistributedType.MULTI_GPU, 8, "bf16"),
    "multi_node.yaml": (DistributedType.MULTI_GPU, 16, "bf16"),
    "fsdp.yaml": (DistributedType.FSDP, 8, "bf16"),
    "deepspeed_zero2.yaml": (DistributedType.DEEPSPEED, 8, "bf16"),
}


def test_the_expected_configs_are_shipped():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_with_accelerates_loader(name):
    config = load_config_from_file(str(CONFIGS / name))
    distributed_type, num_processes, mixed_precision = EXPECTED[name]
    assert config.distributed_type == distributed_type
    assert config.num_processes == num_processes
    assert config.mixed_precision == mixed_precision


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_key_is_commented(name):
    for line in (CONFIGS / name).read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#") and not line.rstrip().endswith(":"):
            assert "#" in line, f"{name}: {line!r} has no comment"


def test_cpu_config_runs_on_cpu_and_multi_node_marks_what_to_edit():
    assert load_config_from_file(str(CONFIGS / "cpu_ddp.yaml")).use_cpu is True
    text = (CONFIGS / "multi_node.yaml").read_text()
    for key in ("num_machines", "num_processes", "machine_rank", "main_process_ip"):
        assert any(line.startswith(key) and "EDIT" in line for line in text.splitlines()), key
