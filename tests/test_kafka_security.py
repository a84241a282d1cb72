"""Kafka client security settings (adaflash/feedback/security.py) and a real TLS round trip.

The cluster listener is SCRAM-SHA-512 over TLS. Tansu 0.6 (the embedded broker) cannot be made
to exercise either half itself: with `--authentication` it refuses every request but ApiVersions
and the SASL handshake until a client logs in, and its users can only be created through the
broker (AlterUserScramCredentials, itself refused) or in a persistent store this build lacks; and
its `--cert`/`--key` flags are declared mutually exclusive, so it cannot serve TLS. So the TLS half
runs against a real Tansu behind a TLS-terminating proxy (what stunnel would be), with our real
producer, admin and consumer clients; the SASL half is checked only as far as the client
arguments (the README lists it under "not exercised").
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest

from adaflash.feedback.broker import free_port, port_open, tansu_binary
from adaflash.feedback.producer import FeedbackProducer, ProducerConfig, broker_answers
from adaflash.feedback.security import ENV, KafkaSecurity, KafkaSecurityError, client_kwargs, plaintext_env

SASL = {
    ENV["protocol"]: "sasl_ssl",
    ENV["sasl_mechanism"]: "scram-sha-512",
    ENV["username"]: "adaflash-governance",
    ENV["password"]: "s3cret-from-the-strimzi-secret",
}


def test_default_is_plaintext_and_builds_todays_clients():
    sec = KafkaSecurity.from_env({})
    assert sec.protocol == "PLAINTEXT" and sec.client_kwargs() == {}
    assert KafkaSecurity.from_env({ENV["protocol"]: " ", ENV["username"]: ""}).client_kwargs() == {}


def test_sasl_ssl_settings_become_kafka_python_arguments(tmp_path):
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    sec = KafkaSecurity.from_env({**SASL, ENV["ssl_cafile"]: str(ca)})
    assert sec.client_kwargs() == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "adaflash-governance",
        "sasl_plain_password": "s3cret-from-the-strimzi-secret",
        "ssl_cafile": str(ca),
    }
    assert "s3cret" not in repr(sec)  # never in a log line or a traceback


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({ENV["protocol"]: "SASL"}, "use one of"),
        ({**SASL, ENV["sasl_mechanism"]: "GSSAPI"}, ENV["sasl_mechanism"]),
        ({k: v for k, v in SASL.items() if k != ENV["password"]}, ENV["password"]),
        ({k: v for k, v in SASL.items() if k != ENV["username"]}, ENV["username"]),
        ({ENV["username"]: "u", ENV["password"]: "p"}, "credentials are set but"),
        (
            {
                ENV["protocol"]: "SASL_PLAINTEXT",
                **{k: SASL[k] for k in list(SASL)[1:]},
                ENV["ssl_cafile"]: "/x",
            },
            "does not use TLS",
        ),  # fmt: skip
        ({ENV["protocol"]: "SSL", ENV["ssl_cafile"]: "/no/such/ca.crt"}, "no such file"),
    ],
)
def test_incomplete_or_contradictory_settings_fail_in_one_line(env, says):
    with pytest.raises(KafkaSecurityError, match=says) as e:
        KafkaSecurity.from_env(env)
    assert "\n" not in str(e.value)


def test_a_bad_setting_stops_a_client_at_start(tmp_path, monkeypatch):
    """The producer reads the settings when it is built, not in its thread on first send."""
    monkeypatch.setenv(ENV["protocol"], "SASL_SSL")
    with pytest.raises(KafkaSecurityError, match=ENV["sasl_mechanism"]):
        FeedbackProducer(ProducerConfig("127.0.0.1:1", tmp_path / "spool"))


def test_the_embedded_stack_runs_plaintext_whatever_the_shell_holds():
    env = plaintext_env({**SASL, "PATH": "/bin", "ADAFLASH_HOME": "/h"})
    assert env == {"PATH": "/bin", "ADAFLASH_HOME": "/h"}


# -- a real TLS round trip --------------------------------------------------------------------------
def _self_signed(tmp_path: Path, name: str) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    crt, pem = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))  # fmt: skip
    return crt, pem


class TlsProxy:
    """TLS on `port`, plaintext to the broker at `upstream`: stunnel's job, in a thread."""

    def __init__(self, port: int, upstream: int, cert: Path, key: Path) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert, key)
        self.upstream = upstream
        self.sock = socket.create_server(("127.0.0.1", port))
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:  # closed by close()
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            client = self.ctx.wrap_socket(conn, server_side=True)
        except (OSError, ssl.SSLError):  # a client that does not speak TLS or distrusts us
            conn.close()
            return
        broker = socket.create_connection(("127.0.0.1", self.upstream))

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    s.close()

        threading.Thread(target=pump, args=(broker, client), daemon=True).start()
        pump(client, broker)

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


@pytest.fixture
def tls_broker(tmp_path):
    """A real Tansu that advertises the TLS proxy's port, so every connection goes through TLS."""
    cert, key = _self_signed(tmp_path, "broker")
    inner, outer = free_port(), free_port()
    log = (tmp_path / "tansu.log").open("wb")
    proc = subprocess.Popen(
        [str(tansu_binary()), "broker", "--listener-url", f"tcp://127.0.0.1:{inner}",
         "--advertised-listener-url", f"tcp://127.0.0.1:{outer}"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    proxy = TlsProxy(outer, inner, cert, key)
    try:
        deadline = time.monotonic() + 20
        while not port_open("127.0.0.1", inner):
            assert proc.poll() is None and time.monotonic() < deadline, "tansu did not start"
            time.sleep(0.05)
        yield f"127.0.0.1:{outer}", f"127.0.0.1:{inner}", cert
    finally:
        proxy.close()
        proc.kill()  # a test broker: nothing to drain (SIGTERM waits for the open connections)
        proc.wait(10)
        log.close()


def test_clients_deliver_over_tls_with_the_configured_ca(tls_broker, tmp_path, monkeypatch):
    from kafka import KafkaConsumer, TopicPartition

    from adaflash.feedback.broker import ensure_topics
    from adaflash.feedback.topics import RAW

    bootstrap, plain, ca = tls_broker
    monkeypatch.setenv(ENV["protocol"], "SSL")
    monkeypatch.setenv(ENV["ssl_cafile"], str(ca))
    tls = KafkaSecurity.from_env()
    # The producer's liveness probe speaks TLS to a TLS listener; a plaintext probe gets nothing.
    assert broker_answers(bootstrap, security=tls)
    assert not broker_answers(bootstrap) and broker_answers(plain)
    # Certificates are verified: a CA that did not sign the broker's is refused.
    other, _ = _self_signed(tmp_path, "other")
    assert not broker_answers(bootstrap, security=KafkaSecurity(protocol="SSL", ssl_cafile=str(other)))

    assert RAW in ensure_topics(bootstrap)  # the admin client, from the environment
    producer = FeedbackProducer(ProducerConfig(bootstrap, tmp_path / "spool"))
    try:
        for i in range(20):
            producer.send_raw(b"tenant-a", f'{{"n": {i}}}'.encode())
        assert producer.flush(60)
        assert producer.stats["sent"] == 20 and producer.stats["spooled"] == 0, producer.stats
    finally:
        producer.close()
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, **client_kwargs(), enable_auto_commit=False)
    try:
        parts = [TopicPartition(RAW, p) for p in sorted(consumer.partitions_for_topic(RAW))]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        got, deadline = [], time.monotonic() + 30
        while len(got) < 20 and time.monotonic() < deadline:
            got += [m.value for msgs in consumer.poll(timeout_ms=500).values() for m in msgs]
    finally:
        consumer.close()
    assert sorted(got) == sorted(f'{{"n": {i}}}'.encode() for i in range(20))
