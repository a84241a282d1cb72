"""How every AdaFlash Kafka client authenticates: one place, read from the environment.

The embedded broker (Tansu on loopback) takes plaintext and no credentials, and that stays the
default, so the local stack is unchanged. On a cluster the Strimzi listener requires SCRAM-SHA-512
over TLS with `authorization: simple` (manifests/base/kafka.yaml): each workload gets its own
KafkaUser, and its Deployment passes that user's credentials in these variables:

    ADAFLASH_KAFKA_SECURITY_PROTOCOL  PLAINTEXT (default) | SSL | SASL_PLAINTEXT | SASL_SSL
    ADAFLASH_KAFKA_SASL_MECHANISM     SCRAM-SHA-512 | SCRAM-SHA-256 | PLAIN (SASL_* only)
    ADAFLASH_KAFKA_USERNAME           the KafkaUser's name
    ADAFLASH_KAFKA_PASSWORD           key `password` of the Secret Strimzi creates for that user
    ADAFLASH_KAFKA_SSL_CAFILE         the cluster CA (Secret <cluster>-cluster-ca-cert, key ca.crt)

Environment, not CLI options: a password on a command line is visible to every process on the
node (`ps`), and the pipeline's KFP steps inherit variables where they cannot take new flags.
The settings are read when a client is built, so a process started with them (serve, governance,
the fleet controller, a pipeline step, `registry approve`) uses them for every connection.
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field

from adaflash.errors import AdaFlashError

ENV = {
    "protocol": "ADAFLASH_KAFKA_SECURITY_PROTOCOL",
    "sasl_mechanism": "ADAFLASH_KAFKA_SASL_MECHANISM",
    "username": "ADAFLASH_KAFKA_USERNAME",
    "password": "ADAFLASH_KAFKA_PASSWORD",
    "ssl_cafile": "ADAFLASH_KAFKA_SSL_CAFILE",
}
PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")


class KafkaSecurityError(AdaFlashError):
    """The Kafka security settings are incomplete or contradict each other."""


@dataclass(frozen=True)
class KafkaSecurity:
    protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never in a log line or a traceback
    ssl_cafile: str | None = None

    def __post_init__(self) -> None:
        # Checked when the settings are read, so a misconfigured pod fails at start in one line
        # instead of timing out on its first connection.
        if self.protocol not in PROTOCOLS:
            raise KafkaSecurityError(
                f"{ENV['protocol']}={self.protocol!r}: use one of {', '.join(PROTOCOLS)}"
            )
        if self.uses_sasl:
            if self.sasl_mechanism not in MECHANISMS:
                raise KafkaSecurityError(
                    f"{ENV['sasl_mechanism']}={self.sasl_mechanism!r}: {self.protocol} needs one of "
                    + ", ".join(MECHANISMS)
                )
            missing = [ENV[k] for k in ("username", "password") if not getattr(self, k)]
            if missing:
                raise KafkaSecurityError(f"{self.protocol} needs {' and '.join(missing)}")
        elif self.sasl_mechanism or self.username or self.password:
            # Credentials with a non-SASL protocol would be silently ignored: say so instead.
            raise KafkaSecurityError(
                f"Kafka credentials are set but {ENV['protocol']} is {self.protocol}: "
                "use SASL_SSL (or SASL_PLAINTEXT) to send them"
            )
        if self.ssl_cafile and not self.uses_tls:
            raise KafkaSecurityError(f"{ENV['ssl_cafile']} is set but {self.protocol} does not use TLS")
        if self.ssl_cafile and not os.path.isfile(self.ssl_cafile):
            raise KafkaSecurityError(f"{ENV['ssl_cafile']}={self.ssl_cafile}: no such file")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KafkaSecurity:
        env = os.environ if environ is None else environ
        values = {k: (env.get(name) or "").strip() or None for k, name in ENV.items()}
        protocol = (values.pop("protocol") or "PLAINTEXT").upper()
        mechanism = values.pop("sasl_mechanism")
        return cls(protocol=protocol, sasl_mechanism=mechanism.upper() if mechanism else None, **values)

    @property
    def uses_sasl(self) -> bool:
        return self.protocol.startswith("SASL_")

    @property
    def uses_tls(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    def client_kwargs(self) -> dict[str, str]:
        """Keyword arguments for KafkaProducer / KafkaConsumer / KafkaAdminClient. Empty for
        PLAINTEXT, so the local stack builds exactly the clients it always did."""
        kw: dict[str, str] = {}
        if self.protocol != "PLAINTEXT":
            kw["security_protocol"] = self.protocol
        if self.uses_sasl:
            kw |= {
                "sasl_mechanism": self.sasl_mechanism,
                "sasl_plain_username": self.username,
                "sasl_plain_password": self.password,
            }
        if self.ssl_cafile:
            kw["ssl_cafile"] = self.ssl_cafile
        return kw

    def wrap(self, sock: socket.socket, host: str) -> socket.socket:
        """A raw probe socket as the broker's listener expects it: TLS when the protocol says so.
        (ApiVersions is answered before SASL authentication, so a probe needs no credentials.)"""
        if not self.uses_tls:
            return sock
        ctx = ssl.create_default_context(cafile=self.ssl_cafile)
        return ctx.wrap_socket(sock, server_hostname=host)


def client_kwargs() -> dict[str, str]:
    """The security keyword arguments of this process's environment (see the module docstring)."""
    return KafkaSecurity.from_env().client_kwargs()


def plaintext_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`environ` without the ADAFLASH_KAFKA_* settings: for processes that talk to the embedded
    broker (`adaflash up`), which takes no credentials even when the shell holds a cluster's."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k not in ENV.values()}
