"""etcd TLS settings: validation, the auth.dir switch, and the certificates `laminar keys` writes.

The handshake itself is exercised against a real etcd in
integration_tests/test_auth.py; here nothing connects.
"""

from __future__ import annotations

import ipaddress

import pytest
from cryptography import x509
from pydantic import ValidationError

from laminar_common.auth import create_keys, etcd_tls_paths
from laminar_common.config import AuthConfig, EtcdConfig, LaminarModel, load_config
from laminar_common.errors import ConfigError
from laminar_common.etcd import EtcdCoordinator
from laminar_common.launch.cli import main


class TierConfig(LaminarModel):
    job: str = "j"
    etcd: EtcdConfig = EtcdConfig()
    auth: AuthConfig = AuthConfig()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return create_keys(tmp_path_factory.mktemp("keys"), etcd_hosts=["etcd-0.internal", "10.1.2.3"])


def test_client_cert_and_key_go_together_and_the_error_names_the_field():
    with pytest.raises(ConfigError, match=r"etcd\.client_cert is set but etcd\.client_key is not"):
        load_config(TierConfig, overrides=["etcd.ca_cert=/ca.pem", "etcd.client_cert=/c.pem"],
                    env={})
    with pytest.raises(ValidationError, match=r"etcd\.client_key is set but etcd\.client_cert"):
        EtcdConfig(ca_cert="/ca.pem", client_key="/k.pem")
    both = EtcdConfig(ca_cert="/ca.pem", client_cert="/c.pem", client_key="/k.pem")
    assert (both.client_cert, both.client_key) == ("/c.pem", "/k.pem")


@pytest.mark.parametrize("settings, message", [
    ({"endpoints": ["https://a:2379", "http://b:2379"]}, "mixes TLS"),
    ({"endpoints": ["http://a:2379"], "ca_cert": "/ca.pem"}, "'http://a:2379' is plaintext"),
    ({"endpoints": ["unix://a:2379"]}, "has scheme 'unix'"),
    ({"client_cert": "/c.pem", "client_key": "/k.pem"}, "TLS to etcd is off"),
])
def test_endpoints_and_tls_files_must_agree(settings, message):
    with pytest.raises(ValidationError, match=message):
        EtcdConfig(**settings)


def test_https_or_a_ca_selects_tls_the_same_way_in_the_coordinator(tmp_path):
    # Both fail on the missing CA file before any connection is tried: TLS was selected.
    with pytest.raises(ConfigError, match=r"etcd\.ca_cert: cannot read"):
        EtcdCoordinator(["127.0.0.1:1"], "j", ca_cert=str(tmp_path / "nope.pem"))
    with pytest.raises(ConfigError, match=r"etcd\.client_cert: cannot read"):
        EtcdCoordinator(["https://127.0.0.1:1"], "j", client_cert=str(tmp_path / "c.pem"),
                        client_key=str(tmp_path / "k.pem"))
    with pytest.raises(ConfigError, match="etcd.client_cert is set but etcd.client_key"):
        EtcdCoordinator(["https://127.0.0.1:1"], "j", client_cert=str(tmp_path / "c.pem"))


def test_auth_dir_turns_etcd_mutual_tls_on(keys):
    cfg = load_config(TierConfig, overrides=[f"auth.dir={keys}"], env={})
    assert cfg.etcd.ca_cert == str(keys / "etcd-ca.pem")
    assert cfg.etcd.client_cert == str(keys / "etcd-client.pem")
    assert cfg.etcd.client_key == str(keys / "etcd-client-key.pem")
    # Programmatic construction follows the same rule.
    built = TierConfig(auth=AuthConfig(dir=str(keys)))
    assert built.etcd.ca_cert == str(keys / "etcd-ca.pem")


def test_explicit_etcd_tls_settings_win_over_auth_dir(keys):
    cfg = load_config(TierConfig, overrides=[f"auth.dir={keys}", "etcd.ca_cert=/other-ca.pem"],
                      env={})
    assert cfg.etcd.ca_cert == "/other-ca.pem"
    assert cfg.etcd.client_cert is None and cfg.etcd.client_key is None


def test_auth_dir_without_etcd_files_leaves_etcd_plaintext(tmp_path):
    plain = create_keys(tmp_path / "plain")
    assert not (plain / "etcd-ca.pem").exists()
    cfg = load_config(TierConfig, overrides=[f"auth.dir={plain}"], env={})
    assert cfg.etcd.ca_cert is None and cfg.etcd.client_cert is None
    assert EtcdConfig().ca_cert is None


def test_auth_dir_with_half_a_client_pair_is_refused(tmp_path):
    d = create_keys(tmp_path / "half", etcd_hosts=[])
    (d / "etcd-client-key.pem").unlink()
    with pytest.raises(ConfigError, match="etcd-client.pem is there but etcd-client-key.pem"):
        load_config(TierConfig, overrides=[f"auth.dir={d}"], env={})
    (d / "etcd-client.pem").unlink()
    assert etcd_tls_paths(d) == {"ca_cert": str(d / "etcd-ca.pem")}


def test_etcd_certificates_name_the_hosts_and_chain_to_their_own_ca(keys):
    ca = x509.load_pem_x509_certificate((keys / "etcd-ca.pem").read_bytes())
    server = x509.load_pem_x509_certificate((keys / "etcd-server.pem").read_bytes())
    client = x509.load_pem_x509_certificate((keys / "etcd-client.pem").read_bytes())
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"localhost", "etcd-0.internal"}
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("10.1.2.3")}
    for cert in (server, client):
        assert cert.issuer == ca.subject
        cert.verify_directly_issued_by(ca)
    grpc_ca = x509.load_pem_x509_certificate((keys / "ca.pem").read_bytes())
    assert grpc_ca.subject != ca.subject


def test_rerunning_keys_adds_etcd_files_and_keeps_the_rest(tmp_path, capsys):
    d = tmp_path / "k"
    assert main(["keys", "--out", str(d)]) == 0
    grpc_ca = (d / "ca.pem").read_bytes()
    assert not (d / "etcd-ca.pem").exists()
    assert main(["keys", "--out", str(d), "--etcd-host", "etcd-0"]) == 0
    assert "--client-cert-auth" in capsys.readouterr().out
    etcd_ca = (d / "etcd-ca.pem").read_bytes()
    assert main(["keys", "--out", str(d), "--etcd"]) == 0
    assert (d / "ca.pem").read_bytes() == grpc_ca
    assert (d / "etcd-ca.pem").read_bytes() == etcd_ca
