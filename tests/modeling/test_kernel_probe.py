"""``--linear-kernel auto`` from a measurement kept per machine: the faster fp32 product here, the same answer in
every process (engine and trainer must agree in true-on-policy mode), pinned by an environment variable."""

import json
import os
import subprocess
import sys

import pytest
import torch

from support_replay.errors import ConfigError
from support_replay.modeling import kernel_probe
from support_replay.modeling.linear_kernels import onednn_available, resolve_linear_kernel

pytestmark = pytest.mark.skipif(not onednn_available(), reason="no oneDNN in this PyTorch: auto is torch")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("SUPPORT_REPLAY_CACHE", str(tmp_path))
    monkeypatch.delenv(kernel_probe.PIN, raising=False)
    kernel_probe.probed_kernel.cache_clear()
    yield tmp_path
    kernel_probe.probed_kernel.cache_clear()


def test_the_choice_is_measured_once_and_kept_for_this_machine(fresh, monkeypatch):
    record = kernel_probe.probe_record()
    for prefix in ("", "train_"):  # the engine's decode rows, the trainer's micro-batch rows
        totals = {"torch": record[f"{prefix}torch_ms"], "onednn": record[f"{prefix}onednn_ms"]}
        assert record[f"{prefix}choice"] == kernel_probe._choose(totals)
        assert totals["torch"] > 0 and totals["onednn"] > 0
    monkeypatch.setattr(kernel_probe, "measure", lambda: pytest.fail("measured again"))
    monkeypatch.setattr(kernel_probe, "measure_training", lambda: pytest.fail("measured again"))
    assert kernel_probe.probe_record() == record  # read back, not measured again
    assert resolve_linear_kernel("auto", torch.float32, "cpu") == record["choice"]
    assert resolve_linear_kernel("auto", torch.float32, "cpu", use="train") == record["train_choice"]
    assert resolve_linear_kernel("auto", torch.bfloat16, "cpu") == "torch"  # bf16's F.linear is oneDNN already
    kept = json.loads((fresh / "kernel-probe.json").read_text())
    assert list(kept) == [kernel_probe.probe_key()] and "torch 2." in kernel_probe.probe_key()


def test_another_isa_cap_is_another_measurement(fresh, monkeypatch):
    first = kernel_probe.probe_key()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert kernel_probe.probe_key() != first and "ONEDNN_MAX_CPU_ISA=AVX2" in kernel_probe.probe_key()


def test_onednn_must_be_clearly_faster():
    assert kernel_probe._choose({"torch": 1.0, "onednn": 0.9}) == "onednn"
    assert kernel_probe._choose({"torch": 1.0, "onednn": 0.97}) == "torch"  # a near tie keeps PyTorch's default


def test_the_environment_pins_it(fresh, monkeypatch):
    monkeypatch.setenv(kernel_probe.PIN, "torch")
    assert resolve_linear_kernel("auto", torch.float32, "cpu") == "torch"
    kernel_probe.probed_kernel.cache_clear()
    monkeypatch.setenv(kernel_probe.PIN, "mkl")
    with pytest.raises(ConfigError, match="SUPPORT_REPLAY_AUTO_KERNEL='mkl': give torch or onednn"):
        kernel_probe.probed_kernel()


@pytest.mark.processes
def test_processes_started_together_agree(fresh):
    """The first to take the lock measures; the others read its answer (a run's engine and trainer ranks)."""
    code = "from support_replay.modeling.kernel_probe import probed_kernel; print(probed_kernel())"
    env = {**os.environ, "SUPPORT_REPLAY_CACHE": str(fresh)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(3)
    ]
    answers = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert len(answers) == 1 and answers <= {"torch", "onednn"}
    assert len(json.loads((fresh / "kernel-probe.json").read_text())) == 1


def test_a_record_from_before_the_trainers_measurement_gets_it_added(fresh, monkeypatch):
    old = {"choice": "onednn", "torch_ms": 5.0, "onednn_ms": 2.0, "threads": 2}
    (fresh / "kernel-probe.json").write_text(json.dumps({kernel_probe.probe_key(): old}))
    monkeypatch.setattr(kernel_probe, "measure", lambda: pytest.fail("the decode measurement is kept"))
    monkeypatch.setattr(kernel_probe, "measure_training", lambda: {"torch": 100.0, "onednn": 120.0})
    record = kernel_probe.probe_record()
    assert record == {**old, "train_choice": "torch", "train_torch_ms": 100.0, "train_onednn_ms": 120.0,
                      "train_threads": torch.get_num_threads()}  # fmt: skip
    assert json.loads((fresh / "kernel-probe.json").read_text()) == {kernel_probe.probe_key(): record}
    assert kernel_probe.probed_kernel("decode") == "onednn" and kernel_probe.probed_kernel("train") == "torch"
    with pytest.raises(ValueError, match="use: 'prefill' is not one of"):
        kernel_probe.probed_kernel("prefill")


@pytest.mark.float_bits
def test_a_trainer_takes_its_own_choice_and_a_true_on_policy_one_the_invariant_product(fresh, monkeypatch):
    from support_replay.train.config import RunConfig

    monkeypatch.setattr(kernel_probe, "measure", lambda: {"torch": 5.0, "onednn": 2.0})
    monkeypatch.setattr(kernel_probe, "measure_training", lambda: {"torch": 100.0, "onednn": 120.0})
    assert RunConfig().trainer_linear_kernel("cpu") == "torch"
    assert RunConfig(true_on_policy_mode=True).trainer_linear_kernel("cpu") == "invariant"
    assert RunConfig(linear_kernel="onednn").trainer_linear_kernel("cpu") == "onednn"  # asked for by name
