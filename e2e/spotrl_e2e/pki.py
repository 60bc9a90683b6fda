"""The test cluster's certificates: one CA, the API server's serving certificate, a client
certificate per identity (admin, controller manager, scheduler, each node) and the
service-account signing key pair. ECDSA P-256 keys: quick to make, accepted everywhere.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Names the API server answers to, in and out of the cluster.
APISERVER_DNS = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)
SERVICE_CIDR = "10.96.0.0/16"
# The first address of the service range is the `kubernetes` Service's ClusterIP.
APISERVER_SERVICE_IP = "10.96.0.1"
_VALIDITY = dt.timedelta(days=365)


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its key as files."""

    cert: Path
    key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(cn: str, orgs: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    return x509.Name([*attrs, x509.NameAttribute(NameOID.COMMON_NAME, cn)])


class ClusterPKI:
    """Creates (once) and hands out the cluster's key material under ``<dir>``."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ca = KeyPair(self.dir / "ca.crt", self.dir / "ca.key")
        if not self.ca.cert.exists():
            self._make_ca()
        self._ca_key = serialization.load_pem_private_key(self.ca.key.read_bytes(), None)
        self._ca_cert = x509.load_pem_x509_certificate(self.ca.cert.read_bytes())
        self.sa_key = self.dir / "sa.key"
        self.sa_pub = self.dir / "sa.pub"
        if not self.sa_key.exists():
            key = _key()
            self.sa_key.write_bytes(_key_pem(key))
            self.sa_pub.write_bytes(
                key.public_key().public_bytes(
                    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
                )
            )

    def _make_ca(self) -> None:
        key = _key()
        now = dt.datetime.now(dt.UTC)
        name = _name("spotrl-test-ca")
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + 10 * _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                    key_encipherment=False, data_encipherment=False, key_agreement=False,
                    encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )  # fmt: skip
        self.ca.key.write_bytes(_key_pem(key))
        self.ca.key.chmod(0o600)
        self.ca.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        file_stem: str,
        cn: str,
        orgs: tuple[str, ...] = (),
        dns: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
        server: bool = False,
    ) -> KeyPair:
        """A certificate signed by the CA (kept if it exists). Clients authenticate as user ``cn``
        in groups ``orgs``; ``server`` adds serverAuth and the SANs."""
        pair = KeyPair(self.dir / f"{file_stem}.crt", self.dir / f"{file_stem}.key")
        if pair.cert.exists() and pair.key.exists():
            return pair
        key = _key()
        now = dt.datetime.now(dt.UTC)
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn, orgs))
            .issuer_name(self._ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._ca_cert.public_key()),  # type: ignore[arg-type]
                critical=False,
            )
        )
        if dns or ips:
            sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
            sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._ca_key, hashes.SHA256())  # type: ignore[arg-type]
        pair.key.write_bytes(_key_pem(key))
        pair.key.chmod(0o600)
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return pair

    # The identities of the control plane, named as Kubernetes' bootstrap RBAC expects them.
    def apiserver(self) -> KeyPair:
        return self.issue(
            "apiserver", "kube-apiserver", dns=APISERVER_DNS, ips=("127.0.0.1", APISERVER_SERVICE_IP), server=True
        )

    def admin(self) -> KeyPair:
        return self.issue("admin", "spotrl-admin", orgs=("system:masters",))

    def controller_manager(self) -> KeyPair:
        return self.issue("kube-controller-manager", "system:kube-controller-manager")

    def scheduler(self) -> KeyPair:
        return self.issue("kube-scheduler", "system:kube-scheduler")

    def apiserver_kubelet_client(self) -> KeyPair:
        """What the API server shows a node's kubelet API (``kubectl logs``)."""
        return self.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", orgs=("system:masters",))

    def node(self, name: str) -> KeyPair:
        """The kubelet's client identity: user ``system:node:<name>`` in group ``system:nodes``."""
        return self.issue(f"node-{name}", f"system:node:{name}", orgs=("system:nodes",))

    def node_serving(self, name: str, ip: str) -> KeyPair:
        """The serving certificate of a node's kubelet API."""
        return self.issue(f"node-{name}-serving", f"system:node:{name}", dns=(name,), ips=(ip,), server=True)


def write_kubeconfig(
    path: Path,
    server: str,
    ca: Path,
    user: str,
    client: KeyPair | None = None,
    token: str | None = None,
    namespace: str | None = None,
) -> Path:
    """A kubeconfig with one cluster, one user (certificate or bearer token) and one context."""
    creds: dict[str, str] = {}
    if client is not None:
        creds = {"client-certificate": str(client.cert), "client-key": str(client.key)}
    if token is not None:
        creds = {"token": token}
    context: dict[str, str] = {"cluster": "spotrl-test", "user": user}
    if namespace:
        context["namespace"] = namespace
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "spotrl-test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": "spotrl-test", "context": context}],
        "current-context": "spotrl-test",
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    path.chmod(0o600)
    return path
