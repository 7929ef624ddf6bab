"""The tests' gates in a process they start (a ``serve``, ray-run's engine actors): with this folder on PYTHONPATH,
``SUPPORT_REPLAY_TEST_STOP_GATE=<samples per group>`` installs tests/stop_gate.py's gate and
``SUPPORT_REPLAY_TEST_PUSH_GATE=1`` tests/push_gate.py's, each once the engine's module has been imported (a process
that never imports it pays nothing). Python imports ``sitecustomize`` at start-up from its path."""

import importlib.abc
import importlib.util
import os
import sys

GATES = {"SUPPORT_REPLAY_TEST_STOP_GATE": "stop_gate", "SUPPORT_REPLAY_TEST_PUSH_GATE": "push_gate"}
ENGINE = "support_replay.engine.engine"


class _AfterTheEngine(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when the engine's module is found, its loading is followed by the gates' install."""

    def find_spec(self, name, path=None, target=None):
        if name != ENGINE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
            for variable, gate in GATES.items():
                if os.environ.get(variable):
                    importlib.import_module(gate).from_environment()

        spec.loader.exec_module = exec_module
        return spec


if any(os.environ.get(variable) for variable in GATES):
    sys.meta_path.insert(0, _AfterTheEngine())
