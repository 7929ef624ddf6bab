"""The project's compiled CPU kernels (csrc/) and their bindings: built once per machine (build.py), imported by
modeling, the engine and the trainer. Imports torch and core only."""
