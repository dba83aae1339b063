"""The scheduling framework: plugin contracts, typed cycle state, the registry, profiles, the config loader.

Pure Python: no grpc, no network I/O. Plugins that need I/O (the precise prefix scorer) reach
it through the :class:`~services.epp.framework.interfaces.PluginHandle` they are built with.
"""
