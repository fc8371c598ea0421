"""kvcoll's benchmarks: `python -m bench` (or `./dev bench`) runs them all.

Benchmarks print numbers and write them to bench/results/; they assert nothing (the
tests do). Each benchmark module exposes `add_arguments(parser)` and `run(args)`.
"""
