"""Every credential a service's config holds is a ``SecretStr``: ``--print-config`` and the start-up ``config`` log
line (both ``model_dump(mode="json")``) show ``**********``, never the key. A fresh user found the router's tenant
client keys (``tenants[].api_keys``) printed in the clear beside a masked ``engine_api_key``, and so echoed by
``kvmesh up`` with a failing router's log tail; the simulator's ``api_key`` (vLLM's ``--api-key``) too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import SecretStr

from engine_simulator.config import SimulatorConfig
from services.epp.config import EppConfig
from services.registration_sidecar.config import SidecarConfig
from services.router.config import RouterConfig
from services.router.tenants import TenantDirectory, TenantSpec

SECRET = "sk-very-secret-0001"

CONFIGS = {
    "router": lambda: RouterConfig(etcd_endpoints=[], engine_api_key=SECRET, engine_api_keys={"m": SECRET},
                                   tenants=[TenantSpec(name="a", api_keys=[SECRET])]),
    "epp": lambda: EppConfig(etcd_endpoints=[], engine_api_key=SECRET, engine_api_keys={"m": SECRET}),
    "registration_sidecar": lambda: SidecarConfig(engine_api_key=SECRET, engine_url="http://127.0.0.1:1", model="m",
                                                  etcd_endpoints=[]),
    "engine_simulator": lambda: SimulatorConfig(api_key=SECRET, etcd_endpoints=[]),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_no_config_dump_shows_a_key(name: str) -> None:
    config = CONFIGS[name]()
    dumped = json.dumps(config.model_dump(mode="json"))
    assert SECRET not in dumped and "**********" in dumped
    assert SECRET not in config.dump_yaml()


def test_every_key_field_is_a_secret() -> None:
    """The kind: a field named like a credential in any service config is a SecretStr (or holds them)."""
    for name, make in CONFIGS.items():
        for field, info in type(make()).model_fields.items():
            if field.endswith(("api_key", "api_keys", "password", "token")) and field != "require_api_key":
                assert "SecretStr" in str(info.annotation), (name, field, info.annotation)
    assert "SecretStr" in str(TenantSpec.model_fields["api_keys"].annotation)


def test_tenant_keys_still_bind() -> None:
    directory = TenantDirectory([TenantSpec(name="a", api_keys=[SECRET])])
    tenant = directory.tenant(SECRET)
    assert tenant is not None and tenant.name == "a"
    assert isinstance(TenantSpec(name="a", api_keys=[SECRET]).api_keys[0], SecretStr)


def test_print_config_masks_tenant_keys() -> None:
    env = {"KVMESH_ROUTER_TENANTS": json.dumps([{"name": "acme", "api_keys": [SECRET]}]), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "services.router", "--print-config"], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert "api_keys" in out and SECRET not in out and "**********" in out
