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
    assert record["choice"] == kernel_probe._choose({"torch": record["torch_ms"], "onednn": record["onednn_ms"]})
    assert record["torch_ms"] > 0 and record["onednn_ms"] > 0
    monkeypatch.setattr(kernel_probe, "measure", lambda: pytest.fail("measured again"))
    assert kernel_probe.probe_record() == record  # read back, not measured again
    assert resolve_linear_kernel("auto", torch.float32, "cpu") == record["choice"]
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
