"""Registration sidecar: keeps an engine's etcd endpoint key alive while the engine's /health answers."""
