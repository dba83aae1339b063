"""The ``kvmesh`` command line: ``up``, ``replay``, ``compare`` (entry point ``kvmesh.cli.main:app``)."""
