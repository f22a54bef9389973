"""Scaffolding for tests and benchmarks (never imported by runtime code).

Runtime modules of the package must not import from here; tests and the
``bench`` commands that launch servers may.
"""
