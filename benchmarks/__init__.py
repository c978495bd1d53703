"""Benchmarks of mpp against a reference, each a module run from the project's folder
(`python -m benchmarks.bench_step`); README.md here says what each measures and where its result is
recorded, and kit.py holds what they share."""
